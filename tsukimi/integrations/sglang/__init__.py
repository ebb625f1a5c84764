"""SGLang on tsukimi: where its venv is (paths.py) and tsukimi's own HiCache storage backend,
loaded through SGLang's `dynamic` storage backend option (docs/compat.md, README)."""
