"""The router process: one `Router` over a `Backend` (tsukimi workers or vLLM instances) places
requests and streams their tokens back; `build_router_app` (app.py) is what `tsukimi router`
serves."""
