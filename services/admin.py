"""The gateway's Admin service: workers, their load and pool occupancy, requests in flight, scaling log."""

from __future__ import annotations

from vlkv.services.metrics import record_loads
from vlkv.v1 import admin_pb2, admin_pb2_grpc


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, gateway, autoscaler=None) -> None:
        self.gateway = gateway
        self.autoscaler = autoscaler

    async def GetStatus(self, request, context):
        router = self.gateway.router
        await router.poll_all()
        out = admin_pb2.ClusterStatus(
            requests_in_flight=self.gateway.in_flight,
            requests_total=self.gateway.requests_total,
            admission_queue=router.num_queued,
        )
        record_loads(self.gateway.metrics, router)
        for kind, pool in (("prefill", router.prefill), ("decode", router.decode)):
            for w in pool.values():
                state = "unreachable" if not w.reachable else "draining" if w.draining else "serving"
                out.workers.append(
                    admin_pb2.WorkerStatus(
                        kind=kind,
                        address=w.address,
                        state=state,
                        running=w.load.running,
                        waiting=w.load.waiting,
                        free_blocks=w.load.free_blocks,
                        total_blocks=w.load.total_blocks,
                        in_flight=w.in_flight,
                        swapped=w.load.swapped,
                        preemptions=w.load.preemptions,
                        kv_dtype=w.load.kv_dtype,
                        block_bytes=w.load.block_bytes,
                        compression_profile=w.load.compression_profile,
                        kv_bytes_window_saved=w.load.kv_bytes_window_saved,
                        retained=w.load.retained,
                        retained_blocks=w.load.retained_blocks,
                    )
                )
                if kind == "prefill" and w.load.HasField("image_cache"):
                    out.workers[-1].image_cache.CopyFrom(w.load.image_cache)
                if kind == "prefill" and w.load.HasField("verifier"):
                    out.workers[-1].verifier.CopyFrom(w.load.verifier)
                if kind == "prefill" and w.load.HasField("prefix_cache"):
                    out.workers[-1].prefix_cache.CopyFrom(w.load.prefix_cache)
        for e in self.autoscaler.events if self.autoscaler else []:
            out.events.append(
                admin_pb2.ScalingEvent(
                    unix_time=e.unix_time, kind=e.kind, action=e.action, replicas=e.replicas, reason=e.reason
                )
            )
        return out
