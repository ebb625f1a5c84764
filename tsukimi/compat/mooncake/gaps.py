"""What of the Mooncake wheel's Python surface the facade does not provide, and why.

The wheel's surface is recorded in tests/compat/mooncake_surface.json (written from the real
0.3.13.post1 wheel by scripts/mooncake_surface.py); tests/compat/test_mooncake_surface.py
compares it with this package and requires every difference to be a row here, and every row
here to still be a difference. docs/compat.md shows the same rows (`markdown()` renders them;
the test checks the doc carries each).

A key is (module, name): name "*" is the whole module, "**" the package and every module
under it, `Class` or `Class.member` one name. Reasons name what is missing on this machine
(a GPU, RDMA/EFA/NVMe-oF hardware, a third-party framework) or why a piece is out of scope.
"""

from __future__ import annotations

GPU = "GPU-only: needs a CUDA/MUSA/MACA build of Mooncake (the non-cuda wheel cannot import or use it either)"
HARDWARE = "hardware-only: needs RDMA/EFA/NVMe-oF devices that tsukimi's transports do not drive"
NOT_BUILT = "the wheel itself fails to import it here"
C_ABI = "returns the address of a C++ object or function for native code; tsukimi has no C++ engine to point at"
OUT_OF_SCOPE = "not yet on tsukimi: a separate tool on top of the store, outside issue 25"
RESHARD = (
    "not yet on tsukimi: Mooncake's framework-neutral weight-resharding planner (pure Python, no store "
    "calls); a large separate library"
)
STRUCTURED = (
    "not yet on tsukimi: the structured store's bundle transfer and DataProto references "
    "(tsukimi has the structured put/get, see docs/compat.md)"
)
SEGMENTS = (
    "not yet on tsukimi: extra segments mounted after setup (tsukimi's client mounts its one segment at "
    "setup; tsukimi's disk tier replaces Mooncake's local-disk segment)"
)

DIFFERENCES: dict[tuple[str, str], str] = {
    ("mooncake._fast_copy", "*"): "a C extension with the wheel's private memcpy helper; tsukimi copies with torch/ctypes",
    ("mooncake.cli", "*"): OUT_OF_SCOPE + " (the `mooncake` command line; tsukimi's is `tsukimi compat`)",
    ("mooncake.cli_bench", "*"): OUT_OF_SCOPE + " (use `tsukimi bench`)",
    ("mooncake.cli_client", "*"): OUT_OF_SCOPE + " (use `tsukimi compat mooncake-client`)",
    ("mooncake.dataproto_catalog", "*"): STRUCTURED,
    ("mooncake.ep", "*"): GPU + "; " + NOT_BUILT + " (WITH_EP=OFF)",
    ("mooncake.pg", "*"): GPU + "; " + NOT_BUILT + " (Mooncake's torch ProcessGroup backend)",
    ("mooncake.mooncake_ep_buffer", "*"): GPU + " (expert-parallel all-to-all buffers on mooncake.ep)",
    ("mooncake.mooncake_elastic_buffer", "*"): GPU + " (elastic EP buffers on mooncake.ep)",
    ("mooncake.fabric_allocator_utils", "*"): GPU + " (finds the NVLink/fabric allocator .so for torch's pluggable allocator)",
    ("mooncake.shared_segment", "*"): GPU + " (cross-process CUDA-registered shared segments)",
    ("mooncake.mooncake_connector_v1", "*"): (
        NOT_BUILT + " without vLLM; tsukimi's vLLM connector is tsukimi.integrations.vllm"
    ),
    ("mooncake.mooncake_ssd_register", "*"): HARDWARE + " (NVMe-oF SSD registration over SSH, paramiko)",
    ("mooncake.mooncake_ssd_unregister", "*"): HARDWARE + " (NVMe-oF SSD registration over SSH, paramiko)",
    ("mooncake.spdk_tgt_create", "*"): HARDWARE + " (SPDK NVMe-oF targets over SSH, paramiko)",
    ("mooncake.mooncake_store_service", "*"): OUT_OF_SCOPE + " (the aiohttp REST store service, mc_store_rest_server)",
    ("mooncake.vllm_v1_proxy_server", "*"): OUT_OF_SCOPE + " (a FastAPI prefill/decode proxy; tsukimi's router is `tsukimi up`)",
    ("mooncake.transfer_engine_topology_dump", "*"): HARDWARE + " (dumps the RDMA NIC/GPU topology)",
    ("mooncake.reshard", "**"): RESHARD,
    ("mooncake.engine", "CoroRPCInterface"): HARDWARE + " (the C++ coroutine RPC over the transfer engine)",
    ("mooncake.engine", "RpcInterface"): HARDWARE + " (the C++ coroutine RPC over the transfer engine)",
    ("mooncake.engine", "ReceivedData"): HARDWARE + " (made by CoroRPCInterface only)",
    ("mooncake.engine", "ReceivedTensor"): HARDWARE + " (made by CoroRPCInterface only)",
    ("mooncake.engine", "create_rpc_client"): HARDWARE + " (CoroRPCInterface)",
    ("mooncake.engine", "create_rpc_server"): HARDWARE + " (CoroRPCInterface)",
    ("mooncake.engine", "SharedSegment"): GPU + " (see mooncake.shared_segment)",
    ("mooncake.engine", "TransferEngine.get_engine_ptr"): C_ABI,
    ("mooncake.engine", "TransferEngine.warmup_efa_segment"): HARDWARE + " (EFA)",
    ("mooncake.store", "MooncakeDistributedStore.get_tensor_into_cuda"): GPU,
    ("mooncake.store", "MooncakeDistributedStore.batch_get_tensor_into_cuda"): GPU,
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.get_tensor_into_cuda"): GPU,
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.batch_get_tensor_into_cuda"): GPU,
    ("mooncake.store", "MooncakeDistributedNoFRegister"): HARDWARE + " (NVMe-oF)",
    ("mooncake.store", "get_alloc_func_addr"): C_ABI + " (torch CUDAPluggableAllocator hooks)",
    ("mooncake.store", "get_free_func_addr"): C_ABI + " (torch CUDAPluggableAllocator hooks)",
    ("mooncake.store", "bind_to_numa_node"): "not yet on tsukimi: pins the calling thread's memory to a NUMA node (libnuma)",
    ("mooncake.store", "EngramStore"): OUT_OF_SCOPE + " (Engram n-gram embedding tables over the store)",
    ("mooncake.store", "EngramStoreConfig"): OUT_OF_SCOPE + " (Engram n-gram embedding tables over the store)",
    ("mooncake.store", "MooncakeDistributedStore.mount_segment"): SEGMENTS,
    ("mooncake.store", "MooncakeDistributedStore.allocate_and_mount_segment"): SEGMENTS,
    ("mooncake.store", "MooncakeDistributedStore.unmount_segment"): SEGMENTS,
    ("mooncake.store", "MooncakeDistributedStore.unmount_and_free_segment"): SEGMENTS,
    ("mooncake.store", "MooncakeDistributedStore.unmount_local_disk_segment"): SEGMENTS,
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.mount_segment"): SEGMENTS,
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.allocate_and_mount_segment"): SEGMENTS,
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.unmount_segment"): SEGMENTS,
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.unmount_and_free_segment"): SEGMENTS,
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.unmount_local_disk_segment"): SEGMENTS,
    ("mooncake.store", "MooncakeDistributedStore.setup"): (
        "the one-argument overload takes its config positionally only (`setup(config)` works, `setup(config=...)` does not)"
    ),
    ("mooncake.async_store", "MooncakeDistributedStoreAsync.setup"): (
        "the one-argument overload takes its config positionally only (`setup(config)` works, `setup(config=...)` does not)"
    ),
    ("mooncake.store", "QueryTaskResponse.__init__"): "made by query_task() only; the wheel's empty constructor is not offered",
    ("mooncake.http_metadata_server", "KVBootstrapServer.__init__"): (
        "host defaults to 127.0.0.1, not 0.0.0.0 (tsukimi binds loopback unless told; `--host` still works)"
    ),
    ("mooncake.structured_object_store", "infer_structure"): "the private `_depth` argument is named `depth`",
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
