"""The worker's micro-batch streams: the coordinator's Forward stream and the predecessor's
Relay stream. Each request is validated against the plan it came under and queued on the
MLX thread; its output goes on to the next stage, or back to the coordinator from the last.
A refused request ends only its stream."""

from __future__ import annotations

import functools
import logging
import threading

import grpc

from common.proto_gen import wedlm_pb2 as pb
from common.wire_frames import Framed
from shard_worker.call_status import status_of
from shard_worker.forward_request import hidden_of, reply_slots, rows_spec
from shard_worker.held_layers import HeldLayers
from shard_worker.mlx_thread import MLXThread, QueueFull, ThreadStopped
from shard_worker.stage_route import Failure, Plan, ReplyChannel, StageRoute
from shard_worker.worker_terminal import WorkerTerminal

log = logging.getLogger(__name__)


class ForwardStreams:
    """Forward and Relay, over the layers this worker holds and the route it follows."""

    def __init__(
        self, layers: HeldLayers, mlx: MLXThread, route: StageRoute, terminal: WorkerTerminal
    ) -> None:
        self.layers = layers
        self.mlx = mlx
        self.route = route
        self.terminal = terminal

    def forward(self, request_iterator, context):
        """The coordinator's stream. Its requests enter this stage; replies (when this is
        the last stage) and a broken relay come back on it."""
        self.terminal.heard()
        channel = self.route.attach()
        reader = threading.Thread(
            target=self._take_all, args=(request_iterator, channel), daemon=True
        )
        reader.start()
        for item in channel.items():
            if isinstance(item, Failure):
                self.route.detach(channel)
                context.abort(item.code, item.message)
            yield item
        self.route.detach(channel)

    def relay(self, request_iterator, context) -> pb.RelayReply:
        """The predecessor's stream: its outputs are this stage's inputs."""
        plan = self.route.plan
        if not plan.prev_stage:
            log.warning(
                "refused a relay from %s: this stage is fed by the coordinator", context.peer()
            )
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker takes no relays under plan {plan.epoch}: the coordinator feeds it",
            )
        received = self._take_all(request_iterator, None, context)
        return pb.RelayReply(received=received)

    def _take_all(self, requests, channel: ReplyChannel | None, context=None) -> int:
        """Take every request of one stream; stop at the first refused one (reported to the
        coordinator, and for a relay also to the sender)."""
        taken, problem = 0, None
        try:
            for request in requests:
                problem = self._take(request, channel)
                if problem is not None:
                    break
                taken += 1
        except grpc.RpcError:  # the sender went away: it reports for itself
            pass
        except Exception as e:  # a malformed frame
            problem = status_of(e)
        if problem is not None:
            self.route.fail(*problem, origin=channel)
        if channel is not None:
            self._close_after_outputs(channel)
        if problem is not None and context is not None:
            context.abort(*problem)
        return taken

    def _close_after_outputs(self, channel: ReplyChannel) -> None:
        """End the stream once the forwards taken from it have answered (outputs are handed
        on in submission order, so a no-op job queued now comes after them)."""
        try:
            self.mlx.submit_pipelined(lambda: None, lambda _: None, lambda *_: channel.close())
        except (QueueFull, ThreadStopped):
            channel.close()

    def _take(self, request: Framed, origin: ReplyChannel | None):
        """Validate one micro-batch and queue it on the MLX thread; its output goes where
        the plan it arrived under says. Returns (code, message) when it is refused."""
        plan = self.route.plan
        if request.plan_epoch != plan.epoch:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"micro-batch {request.batch_id} belongs to plan {request.plan_epoch}; "
                f"this worker follows plan {plan.epoch}",
            )
        if self.layers.state.layer_range is None:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker holds no layers yet: it waits for the coordinator's Assign",
            )
        config = self.layers.config
        try:
            spec = rows_spec(request, config.hidden_size, config.max_position_embeddings)
            slots = reply_slots(request, spec)  # checked here, applied by the last stage
            hidden = hidden_of(request)
            if plan.next_stage:
                slots = None
            launch = functools.partial(self.layers.launch, spec, hidden, slots)
            header = request.message  # every field but the hidden states: relayed as is
            done = functools.partial(self._done, plan, header, origin)
            self.mlx.submit_pipelined(launch, self.layers.finish, done)
        except Exception as e:
            return status_of(e)
        return None

    def _done(
        self,
        plan: Plan,
        request: pb.ForwardRequest,
        origin: ReplyChannel | None,
        result,
        queue_s: float,
    ) -> None:
        """On the MLX thread, in order: hand the output on (nothing here blocks)."""
        if isinstance(result, BaseException):
            self.route.fail(*status_of(result), origin=origin)
            return
        hidden, compute_s = result
        request.stage_compute_s.append(compute_s)
        reply = pb.ForwardReply(
            batch_id=request.batch_id,
            compute_s=compute_s,
            queue_s=queue_s,
            stage_compute_s=request.stage_compute_s,
        )
        self.route.deliver(plan, request, reply, hidden, origin)
