"""The master's request handler: protocol messages in, results out, over a `MasterState`.

Pure like the state machine (the RPC server and the tests call `handle` directly). Single
operations raise typed errors, which the RPC layer sends as (code, message); a `Batch`
reports each operation's error as a `Failure` in its place, so one bad key never fails the
others.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from tsukimi.errors import InvalidArgument, TsukimiError
from tsukimi.store import disk_protocol as dp
from tsukimi.store import protocol as p
from tsukimi.store.master import admin, disk_ops
from tsukimi.store.master.state import MasterState


class MasterService:
    def __init__(self, state: MasterState) -> None:
        self.state = state
        self._handlers: dict[type[msgspec.Struct], Callable[[msgspec.Struct], msgspec.Struct]] = {
            p.Heartbeat: self._heartbeat,
            p.MountSegment: self._mount,
            p.UnmountSegment: self._unmount,
            p.PutStart: self._put_start,
            p.PutEnd: self._put_end,
            p.PutRevoke: self._put_revoke,
            p.GetReplicas: self._get_replicas,
            p.Exists: self._exists,
            p.ExistsMany: self._exists_many,
            p.Remove: self._remove,
            p.RemoveAll: self._remove_all,
            p.Batch: self._batch,
            p.QueryKey: self._query_key,
            p.ListSegments: self._segments,
            p.ClearReplicas: self._clear_replicas,
            p.RemoveMatching: self._remove_matching,
            p.DescribeKeys: self._describe_keys,
            p.CreateCopyTask: self._create_copy,
            p.CreateMoveTask: self._create_move,
            p.QueryTask: self._query_task,
            p.FinishTask: self._finish_task,
            dp.MountDisk: self._mount_disk,
            dp.UnmountDisk: self._unmount_disk,
            dp.RegisterDiskFiles: self._register_disk_files,
            dp.DiskSync: self._disk_sync,
            dp.MasterInfo: self._master_info,
        }

    def handle(self, request: msgspec.Struct) -> msgspec.Struct:
        """Apply one request (mutates the state). Raises the operation's TsukimiError."""
        handler = self._handlers.get(type(request))
        if handler is None:
            raise InvalidArgument(f"the master does not handle {type(request).__name__}")
        return handler(request)

    def _heartbeat(self, op: msgspec.Struct) -> p.HeartbeatResult:
        assert isinstance(op, p.Heartbeat)
        known = self.state.registry.heartbeat(op.client_id, self.state.clock.now())
        return p.HeartbeatResult(known, admin.take_tasks(self.state, op.client_id) if known else [])

    def _mount(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, p.MountSegment)
        self.state.mount(op)
        return p.Ok()

    def _unmount(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, p.UnmountSegment)
        self.state.unmount(op.client_id, op.segment_id)
        return p.Ok()

    def _put_start(self, op: msgspec.Struct) -> p.PutStartResult:
        assert isinstance(op, p.PutStart)
        replicas = self.state.put_start(op.client_id, op.key, op.size, op.config, op.upsert, op.put_id, op.checksum)
        return p.PutStartResult(replicas, self.state.pending[op.key].put_id, self.state.config.put_timeout_s)

    def _put_end(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, p.PutEnd)
        self.state.put_end(op.client_id, op.key, op.put_id)
        return p.Ok()

    def _put_revoke(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, p.PutRevoke)
        self.state.put_revoke(op.client_id, op.key, op.put_id)
        return p.Ok()

    def _get_replicas(self, op: msgspec.Struct) -> p.GetReplicasResult:
        assert isinstance(op, p.GetReplicas)
        now = self.state.clock.now()
        record, replicas = self.state.read(op.key, now)
        if record is None:
            return p.GetReplicasResult([], 0)
        disk = self.state.tiers.locations(record, now)
        return p.GetReplicasResult(replicas, record.size, self.state.config.lease_ttl_s, record.checksum, disk)

    def _exists(self, op: msgspec.Struct) -> p.ExistsResult:
        assert isinstance(op, p.Exists)
        return p.ExistsResult(self.state.exists(op.key))

    def _exists_many(self, op: msgspec.Struct) -> p.ExistsManyResult:
        assert isinstance(op, p.ExistsMany)
        if len(op.keys) > p.MAX_BATCH:
            raise InvalidArgument(f"at most {p.MAX_BATCH} keys per call, got {len(op.keys)}")
        exists = self.state.exists
        return p.ExistsManyResult([exists(key) for key in op.keys])

    def _remove(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, p.Remove)
        self.state.remove(op.key, op.force)
        return p.Ok()

    def _remove_all(self, op: msgspec.Struct) -> p.RemoveAllResult:
        assert isinstance(op, p.RemoveAll)
        return p.RemoveAllResult(self.state.remove_all(op.force))

    def _batch(self, op: msgspec.Struct) -> p.BatchResult:
        assert isinstance(op, p.Batch)
        if len(op.ops) > p.MAX_BATCH:
            raise InvalidArgument(f"a batch holds at most {p.MAX_BATCH} operations, got {len(op.ops)}")
        results: list[p.BatchResultItem] = []
        for item in op.ops:
            try:
                result = self.handle(item)
            except TsukimiError as exc:
                results.append(p.Failure(exc.code, str(exc)))
            else:
                assert isinstance(result, p.Ok | p.PutStartResult | p.GetReplicasResult | p.ExistsResult)
                results.append(result)
        return p.BatchResult(results)

    def _query_key(self, op: msgspec.Struct) -> p.ObjectInfo:
        assert isinstance(op, p.QueryKey)
        return self.state.describe(op.key)

    def _segments(self, op: msgspec.Struct) -> p.SegmentsResult:
        return p.SegmentsResult(self.state.registry.infos(self.state.clock.now()))

    # -- admin.py: many keys, replica sets, copy / move tasks ----------------------------

    def _clear_replicas(self, op: msgspec.Struct) -> p.KeysResult:
        assert isinstance(op, p.ClearReplicas)
        return p.KeysResult(admin.clear_replicas(self.state, op.keys, op.te_segment))

    def _remove_matching(self, op: msgspec.Struct) -> p.RemoveAllResult:
        assert isinstance(op, p.RemoveMatching)
        return p.RemoveAllResult(admin.remove_matching(self.state, op.pattern, op.force))

    def _describe_keys(self, op: msgspec.Struct) -> p.DescribeResult:
        assert isinstance(op, p.DescribeKeys)
        return p.DescribeResult(admin.describe_keys(self.state, op.keys))

    def _create_copy(self, op: msgspec.Struct) -> p.TaskCreated:
        assert isinstance(op, p.CreateCopyTask)
        return p.TaskCreated(admin.create_copy(self.state, op.key, op.targets, op.task_id))

    def _create_move(self, op: msgspec.Struct) -> p.TaskCreated:
        assert isinstance(op, p.CreateMoveTask)
        return p.TaskCreated(admin.create_move(self.state, op.key, op.source, op.target, op.task_id))

    def _query_task(self, op: msgspec.Struct) -> p.TaskInfo:
        assert isinstance(op, p.QueryTask)
        return admin.query_task(self.state, op.task_id)

    def _finish_task(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, p.FinishTask)
        admin.finish_task(self.state, op.client_id, op.task_id, op.error)
        return p.Ok()

    def _mount_disk(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, dp.MountDisk)
        disk_ops.mount(self.state.tiers, op, self.state.clock.now())
        return p.Ok()

    def _unmount_disk(self, op: msgspec.Struct) -> p.Ok:
        assert isinstance(op, dp.UnmountDisk)
        disk_ops.unmount(self.state.tiers, op.client_id, op.disk_id, self.state.clock.now())
        return p.Ok()

    def _register_disk_files(self, op: msgspec.Struct) -> dp.DiskFilesResult:
        assert isinstance(op, dp.RegisterDiskFiles)
        return dp.DiskFilesResult(disk_ops.register(self.state.tiers, op, self.state.clock.now()))

    def _disk_sync(self, op: msgspec.Struct) -> dp.DiskSyncResult:
        assert isinstance(op, dp.DiskSync)
        return disk_ops.sync(self.state.tiers, op, self.state.clock.now())

    def _master_info(self, op: msgspec.Struct) -> dp.MasterInfoResult:
        return dp.MasterInfoResult(self.state.config.offload, self.state.config.disk_root)
