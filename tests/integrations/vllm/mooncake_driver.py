"""Run inside `.venv-vllm` by test_mooncake_connectors.py (not a test module itself): one
`vllm.LLM`, with vLLM's MooncakeStoreConnector or with no connector, generates greedily for
token-id prompts in order and writes what the test compares as JSON.

    python mooncake_driver.py '{"model": ..., "connector": true, "prompts": [[...], ...],
                                "max_tokens": 16, "out": "result.json",
                                "master_http": "http://127.0.0.1:PORT", "min_keys": 5}'

The output records which module `mooncake.store` resolved to (tsukimi's, under `tsukimi
compat exec`), and per prompt the generated token ids, vLLM's `num_cached_tokens` (tokens
not computed here: with local prefix caching off, those loaded from the pool) and the keys
in the pool after it. The connector saves in a background thread: after each prompt the
driver waits (up to 60 s) for `min_keys` keys in the pool, so that the next prompt's lookup
sees them (without it, a prompt sent at once races the save of the one before).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request


def keys_in_pool(master_http: str) -> int:
    with urllib.request.urlopen(master_http + "/get_all_keys", timeout=5) as reply:
        return len(reply.read().decode().split())


def wait_for_keys(master_http: str, min_keys: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (count := keys_in_pool(master_http)) < min_keys and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv_transfer = None
    store_module = ""
    if args["connector"]:
        import mooncake.store

        store_module = mooncake.store.MooncakeDistributedStore.__module__
        kv_transfer = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both")
    llm = LLM(
        model=args["model"],
        dtype="float32",
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer,
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True, detokenize=False)
    runs = []
    for prompt in args["prompts"]:
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        keys = wait_for_keys(args["master_http"], args["min_keys"]) if args.get("master_http") else 0
        runs.append(
            {"tokens": list(output.outputs[0].token_ids), "num_cached_tokens": output.num_cached_tokens, "keys": keys}
        )
    with open(args["out"], "w") as f:
        json.dump({"store_module": store_module, "runs": runs}, f)


if __name__ == "__main__":
    main()
