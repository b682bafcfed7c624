"""Scheduler.update_from_output: commit a step's results.

The steady rows a step scheduled in bulk are committed in bulk (engine/steady.py); the others, and a steady row
whose burst stopped, one by one.
"""

from __future__ import annotations

from ttsserve.engine.outputs import RequestUpdate, SchedulerOutput
from ttsserve.engine.request import Request, RequestStatus
from ttsserve.engine.steady import commit_burst

_RUNNING = RequestStatus.RUNNING
_MISSING = object()


class OutputCommitter:
    """Mixed into Scheduler: uses its requests, running, waiting, swapped, token_limit and _finish."""

    def update_from_output(
        self, sched_out: SchedulerOutput, sampled: dict[str, object], stop: dict[str, bool]
    ) -> list[RequestUpdate]:
        """Advance every scheduled request; append samples; finish on stop / length; free finished blocks.

        sampled: {request_id: token item} for every scheduled request with will_sample; for a decode burst
            (num_steps > 1) the list of its samples up to, without, the first EOS.
        stop: {request_id: True} when that sample is the end marker (EOS; not appended), or the burst reached one.
        Returns one RequestUpdate per request that sampled.
        """
        updates: list[RequestUpdate] = []
        if sched_out.steady_rows:  # the steady rows in bulk; a burst that stopped goes the per-row way
            b = sched_out.steady_num_steps
            updates, stopped = commit_burst(sched_out.steady_rows, sched_out.steady_ids, b, sampled, stop)
            updates.extend(self._commit(req, b, True, b, sampled, stop) for req in stopped)
        get_request = self.requests.get
        for s in sched_out.scheduled if sched_out.per_row is None else sched_out.per_row:
            req = get_request(s.request_id)
            if req is None or req.status is not _RUNNING:
                continue  # finished, aborted or preempted since it was scheduled: its results are dropped
            update = self._commit(req, s.num_new_tokens, s.will_sample, s.num_steps, sampled, stop)
            if update is not None:
                updates.append(update)
        if len(self.running) != len(self.requests) - len(self.waiting) - len(self.swapped):  # some finished
            self.running = [r for r in self.running if not r.is_finished]
        return updates

    def _commit(
        self, req: Request, n: int, will_sample: bool, num_steps: int, sampled: dict, stop: dict
    ) -> RequestUpdate | None:
        """Commit n computed positions of req; append what it sampled (None: it did not sample)."""
        rid = req.request_id
        req.num_computed_tokens += n
        req.num_inflight_tokens -= n
        assert req.num_inflight_tokens >= 0, f"{rid}: committed more than was in flight"
        if not will_sample:
            return None
        if num_steps > 1:
            return self._commit_burst(req, num_steps, sampled, stop)
        req.num_inflight_outputs -= 1
        if stop and stop.get(rid, False):
            token, status = None, RequestStatus.FINISHED_STOPPED
        else:
            token = sampled.get(rid, _MISSING)
            if token is _MISSING:
                raise ValueError(f"runner output has no sample for request {rid!r}")
            outputs = req.output_token_ids
            outputs.append(token)
            n_out = len(outputs)  # num_output_tokens; + the prompt: num_tokens
            if n_out < req.max_new_tokens and len(req.prompt_token_ids) + n_out < self.token_limit:
                return RequestUpdate(rid, token, False, None)  # the common case: no finish
            status = RequestStatus.FINISHED_LENGTH
        self._finish(req, status)
        return RequestUpdate(rid, token, True, status.value, 0 if token is None else 1)

    def _commit_burst(self, req: Request, num_steps: int, sampled: dict, stop: dict) -> RequestUpdate:
        """Append a decode burst's samples (its positions are already committed) until EOS or a length limit."""
        rid = req.request_id
        req.num_inflight_outputs -= num_steps
        items = sampled.get(rid, _MISSING)
        if items is _MISSING or len(items) > num_steps:
            raise ValueError(f"runner output has no burst of <= {num_steps} samples for request {rid!r}")
        outputs, n_prompt = req.output_token_ids, len(req.prompt_token_ids)
        room = min(req.max_new_tokens, self.token_limit - n_prompt) - len(outputs)
        outputs.extend(items[:room])
        n = min(len(items), room)
        token = outputs[-1] if n else None
        if n == room:
            status = RequestStatus.FINISHED_LENGTH
        elif stop and stop.get(rid, False):
            status = RequestStatus.FINISHED_STOPPED
        else:
            assert n == num_steps, f"{rid}: a burst without EOS returned {n} of {num_steps} samples"
            return RequestUpdate(rid, token, False, None, n)
        self._finish(req, status)
        return RequestUpdate(rid, token, True, status.value, n)
