"""Run inside `.venv-sglang` under `tsukimi compat exec` by test_pd.py (not a test module
itself): SGLang's PD transfer-engine wrapper, `MooncakeTransferEngine`, on both sides in one
process (the wrapper holds no global state; `init_mooncake_transfer_engine` alone does), moving
KV pages the way `MooncakeKVManager.send_kvcache` addresses them. Writes JSON.

    python pd_driver.py '{"out": "result.json"}'

The KV layout is a device pool's: per layer a K and a V buffer of `SLOTS` pages of `item_len`
bytes; `kv_data_ptrs` = K pointers then V pointers, as the KV manager registers them. The
prefill's page indices go to the decode's through `group_concurrent_contiguous` (one block per
contiguous run), and each layer's K and V blocks are one `batch_transfer_sync` (`_transfer_data`).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

LAYERS = 3
SLOTS = 32  # pages per buffer
ITEM_LEN = 2 * 8 * 16 * 2  # bytes per page: page_size 2, 8 heads, head_dim 16, bf16
PREFILL_PAGES = [3, 4, 5, 9, 10, 17, 30]
DECODE_PAGES = [0, 1, 2, 6, 12, 13, 20]  # runs differ from the prefill's: 5 blocks


def kv_buffers(seed: int | None) -> list[torch.Tensor]:
    """K buffers of every layer, then V buffers: random bytes (seed) or zeros."""
    if seed is None:
        return [torch.zeros(SLOTS * ITEM_LEN, dtype=torch.uint8) for _ in range(2 * LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (SLOTS * ITEM_LEN,), dtype=torch.uint8, generator=gen) for _ in range(2 * LAYERS)]


def send_kvcache(engine, session: str, src: list[int], dst: list[int], item_lens: list[int]) -> list[int]:
    """MooncakeKVManager's MHA path: K of each layer, then V, one batch per layer buffer."""
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

    src_blocks, dst_blocks = group_concurrent_contiguous(
        np.array(PREFILL_PAGES, dtype=np.int32), np.array(DECODE_PAGES, dtype=np.int32)
    )
    answers = []
    for src_ptr, dst_ptr, item_len in zip(src, dst, item_lens, strict=True):
        blocks = [
            (src_ptr + int(s[0]) * item_len, dst_ptr + int(d[0]) * item_len, item_len * len(s))
            for s, d in zip(src_blocks, dst_blocks, strict=True)
        ]
        srcs, dsts, lens = zip(*blocks, strict=True)
        answers.append(engine.batch_transfer_sync(session, list(srcs), list(dsts), list(lens)))
    return answers


def main() -> None:
    args = json.loads(sys.argv[1])
    import mooncake.engine
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

    from tsukimi.netio import free_port

    prefill, decode = MooncakeTransferEngine("127.0.0.1"), MooncakeTransferEngine("127.0.0.1")
    src, dst = kv_buffers(seed=1), kv_buffers(seed=None)
    src_ptrs, dst_ptrs = [t.data_ptr() for t in src], [t.data_ptr() for t in dst]
    lens = [t.nbytes for t in src]
    item_lens = [ITEM_LEN] * len(src)
    blocks = group_concurrent_contiguous(np.array(PREFILL_PAGES, dtype=np.int32), np.array(DECODE_PAGES, np.int32))
    result: dict[str, object] = {
        "engine_module": mooncake.engine.TransferEngine.__module__,
        "blocks": len(blocks[0]),
        "register": [prefill.batch_register(src_ptrs, lens), decode.batch_register(dst_ptrs, lens)],
        "probe_live": prefill.send_probe(decode.get_session_id()),
        "probe_dead": prefill.send_probe(f"127.0.0.1:{free_port()}"),
    }
    result["send"] = send_kvcache(prefill, decode.get_session_id(), src_ptrs, dst_ptrs, item_lens)
    pages_equal, untouched_zero, compared = True, True, 0
    for s, d in zip(src, dst, strict=True):
        s_pages, d_pages = s.view(SLOTS, ITEM_LEN), d.view(SLOTS, ITEM_LEN)
        pages_equal &= torch.equal(s_pages[PREFILL_PAGES], d_pages[DECODE_PAGES])
        others = [i for i in range(SLOTS) if i not in DECODE_PAGES]
        untouched_zero &= not d_pages[others].any().item()
        compared += d_pages[DECODE_PAGES].nbytes
    result.update(pages_equal=pages_equal, untouched_zero=untouched_zero, bytes_compared=compared)
    # a write that runs 16 bytes past the end of the decode's last registered buffer
    end = dst_ptrs[-1] + lens[-1]
    result["out_of_bounds"] = prefill.transfer_sync(decode.get_session_id(), src_ptrs[0], end - 48, 64)
    result["in_bounds"] = prefill.transfer_sync(decode.get_session_id(), src_ptrs[0], end - 64, 64)
    result["deregister"] = decode.batch_deregister(dst_ptrs)
    result["send_after_deregister"] = send_kvcache(prefill, decode.get_session_id(), src_ptrs, dst_ptrs, item_lens)
    with open(args["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
