"""What of the Mooncake wheel's Python surface the facade does not provide, and why.

The wheel's surface is recorded in tests/compat/mooncake_surface.json (written from the real
0.3.13.post1 wheel by scripts/mooncake_surface.py); tests/compat/test_mooncake_surface.py
compares it with this package and requires every difference to be a row here, and every row
here to still be a difference. docs/compat.md shows the same rows (`markdown()` renders them;
the test checks the doc carries each).

A key is (module, name): name "*" is the whole module, "**" the package and every module
under it, `Class` or `Class.member` one name. The async store inherits the store's methods,
so a store row covers its async twin. Reasons name what is missing on this machine
(a GPU, RDMA/EFA/NVMe-oF hardware, a third-party framework) or why a piece is out of scope.
"""

from __future__ import annotations

GPU = "GPU-only (a CUDA/MUSA build of Mooncake)"
HARDWARE = "hardware-only (RDMA/EFA/NVMe-oF devices, which tsukimi does not drive)"
NOT_BUILT = "the non-cuda wheel cannot import it either"
C_ABI = "a native pointer into Mooncake's C++ engine; tsukimi has none"
CORO_RPC = "Mooncake's C++ coro_rpc wire protocol (yalantinglibs); not on tsukimi"
OUT_OF_SCOPE = "not on tsukimi yet: a separate tool, outside issue 25"
RESHARD = "not on tsukimi yet: Mooncake's weight-resharding planner, a separate pure-Python library"
STRUCTURED = "not on tsukimi yet: bundle transfers and DataProto references (the structured put/get are)"

DIFFERENCES: dict[tuple[str, str], str] = {
    ("mooncake._fast_copy", "*"): "the wheel's private C copy helper; tsukimi copies with torch",
    ("mooncake.cli_bench", "*"): (
        "transfer_engine_bench runs one side (--mode=target, or initiator against a --segment_id elsewhere);"
        " its flags do not map onto `tsukimi bench transfer`, which runs both sides on this host over a grid"
    ),
    ("mooncake.dataproto_catalog", "*"): STRUCTURED,
    ("mooncake.ep", "*"): GPU + "; " + NOT_BUILT + " (WITH_EP=OFF)",
    ("mooncake.pg", "*"): GPU + "; " + NOT_BUILT + " (Mooncake's torch ProcessGroup backend)",
    ("mooncake.mooncake_ep_buffer", "*"): GPU + " (expert-parallel all-to-all buffers on mooncake.ep)",
    ("mooncake.mooncake_elastic_buffer", "*"): GPU + " (elastic EP buffers on mooncake.ep)",
    ("mooncake.fabric_allocator_utils", "*"): GPU + " (the NVLink/fabric allocator for torch)",
    ("mooncake.shared_segment", "*"): GPU + " (CUDA-registered shared segments)",
    ("mooncake.mooncake_connector_v1", "*"): "needs vLLM (so does the wheel's); tsukimi's is tsukimi.integrations.vllm",
    ("mooncake.mooncake_ssd_register", "*"): HARDWARE + " (NVMe-oF SSD registration over SSH, paramiko)",
    ("mooncake.mooncake_ssd_unregister", "*"): HARDWARE + " (NVMe-oF SSD registration over SSH, paramiko)",
    ("mooncake.spdk_tgt_create", "*"): HARDWARE + " (SPDK NVMe-oF targets over SSH, paramiko)",
    ("mooncake.vllm_v1_proxy_server", "*"): OUT_OF_SCOPE + " (a FastAPI PD proxy; see `tsukimi up`)",
    ("mooncake.transfer_engine_topology_dump", "*"): HARDWARE + " (dumps the RDMA NIC/GPU topology)",
    ("mooncake.reshard", "**"): RESHARD,
    ("mooncake.engine", "CoroRPCInterface"): CORO_RPC,
    ("mooncake.engine", "RpcInterface"): CORO_RPC,
    ("mooncake.engine", "ReceivedData"): CORO_RPC + " (made by CoroRPCInterface only)",
    ("mooncake.engine", "ReceivedTensor"): CORO_RPC + " (made by CoroRPCInterface only)",
    ("mooncake.engine", "create_rpc_client"): CORO_RPC,
    ("mooncake.engine", "create_rpc_server"): CORO_RPC,
    ("mooncake.engine", "SharedSegment"): GPU + " (see mooncake.shared_segment)",
    ("mooncake.engine", "TransferEngine.get_engine_ptr"): C_ABI,
    ("mooncake.engine", "TransferEngine.warmup_efa_segment"): HARDWARE + " (EFA)",
    ("mooncake.store", "MooncakeDistributedStore.get_tensor_into_cuda"): GPU,
    ("mooncake.store", "MooncakeDistributedStore.batch_get_tensor_into_cuda"): GPU,
    ("mooncake.store", "MooncakeDistributedNoFRegister"): HARDWARE + " (NVMe-oF)",
    ("mooncake.store", "get_alloc_func_addr"): C_ABI + " (torch CUDAPluggableAllocator hooks)",
    ("mooncake.store", "get_free_func_addr"): C_ABI + " (torch CUDAPluggableAllocator hooks)",
    ("mooncake.store", "EngramStore"): OUT_OF_SCOPE + " (Engram n-gram embedding tables over the store)",
    ("mooncake.store", "EngramStoreConfig"): OUT_OF_SCOPE + " (Engram n-gram embedding tables over the store)",
    ("mooncake.store", "QueryTaskResponse.__init__"): "made by query_task() only: no empty constructor",
    ("mooncake.http_metadata_server", "KVBootstrapServer.__init__"): "host defaults to 127.0.0.1 (the wheel: 0.0.0.0)",
}
for _name in (
    "AUTO_PARALLEL_MIN_BYTES",
    "AUTO_PARALLEL_MIN_CHUNKS",
    "BundleStore",
    "BundleTransferPolicy",
    "DATAPROTO_REF_HANDLE_TYPE",
    "DATAPROTO_REF_HANDLE_VERSION",
    "DEFAULT_BUNDLE_CHUNK_BYTES",
    "FieldSchema",
    "MISSING_OBJECT_ERROR",
    "MooncakeBundleTransfer",
    "MooncakeDataProtoRef",
    "RemoteBundleRef",
    "STORAGE_GROUP_ID",
    "STRUCTURED_FIELD_SPECS_KEY",
    "StructuredFieldLocation",
    "StructuredMemberSlice",
    "StructuredObjectPayload",
    "StructuredObjectReadSpec",
    "StructuredObjectResult",
    "export_dataproto_ref",
    "export_ref",
    "import_dataproto_ref",
    "import_ref",
    "is_dataproto_ref_handle",
    "raw_destination",
    "tensor_object_buffer",
):
    DIFFERENCES["mooncake.structured_object_store", _name] = STRUCTURED


def covering(module: str, name: str) -> tuple[str, str] | None:
    """The row that lists the difference at (module, name), or None.

    Args:
        module: the wheel's module, e.g. "mooncake.store".
        name: "*" for the whole module, else the (dotted) name in it.

    Returns:
        The key of DIFFERENCES that covers it: itself, or a "**" row of a package above.
    """
    if (module, name) in DIFFERENCES:
        return module, name
    inherited = name.removeprefix("MooncakeDistributedStoreAsync.")
    if module == "mooncake.async_store" and inherited != name:
        return covering("mooncake.store", f"MooncakeDistributedStore.{inherited}")
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        package = ".".join(parts[:end])
        if (package, "**") in DIFFERENCES:
            return package, "**"
    return None


def markdown() -> str:
    """The rows as the Markdown table docs/compat.md shows (sorted by module and name)."""
    lines = ["| wheel module | name | why the facade lacks it |", "|---|---|---|"]
    for (module, name), reason in sorted(DIFFERENCES.items()):
        shown = {"*": "(whole module)", "**": "(package, every module under it)"}.get(name, f"`{name}`")
        lines.append(f"| `{module}` | {shown} | {reason} |")
    return "\n".join(lines) + "\n"
