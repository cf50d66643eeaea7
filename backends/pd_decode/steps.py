"""Decode's steps, overlapped like the offline engine's: a greedy graph batch for step n+1 is launched before step
n's tokens are read, so the host schedules, emits and prepares while the GPU computes.

While a step is launched and unread, each of its requests ends with a placeholder token (PENDING); the device knows
the real one and feeds it to the next step (a span id of -1, see `GpuLlama.launch_greedy`). Nothing may look at
those requests' token histories until the step is read, so the loop schedules over an unread step only when the
plan is certain to be one more decode token for every running request (`may_keep`):

- every request runs and nothing is in flight, or else the scheduler is `quiet` (no input came since its last full
  plan, which took every action then due, and no turn of rotation is due: what waits still cannot fit, and what
  recovers or waits for its prompt changes only when its transfer or host copy answers; an answer that makes its
  request run keeps the quiet state, the request joining the batch with its own last token), and then
  the plan is made with `schedule(decode_only=True)`: no admission, no rotation, no recovery, so no slot goes to
  prefill (another process) or to the host tier's copy stream while the GPU may still write it. A transfer or
  copy in flight writes only its own request's slots and state page, which the step does not touch;
- the pool's free slots and unlocked cache entries hold a slot for every running request: the reservation pauses
  nobody (evicting an unlocked entry is safe: the unread step neither reads nor writes its slots, and what it
  becomes is written by a later step on the same stream);
- no running request is within one token of `max_len`, and every one is greedy with nothing banned;
- the batch replays a captured graph.

Everything else reads the step first (`flush`), as do cancellations and the end of the loop. A request that stops
at step n (EOS, max_tokens, a stop id) has computed one row of step n+1 for nothing: its placeholder is dropped and
the slot that row wrote goes back to the pool, exactly as the synchronous loop leaves it."""

from __future__ import annotations

from collections.abc import Callable

from backends.common.core.request import InferReq, ReqState
from backends.common.core.speculative import ngram_draft
from backends.common.engine.postprocess import PENDING, LaunchedStep, greedy_unbanned, next_tokens, sample_requests
from backends.common.model.batch import Span

from .scheduler import DecodeScheduler


class DecodeSteps:
    def __init__(
        self,
        runner,
        sched: DecodeScheduler,
        eos_ids: list[int],
        on_token: Callable[[InferReq, int, int], None],
        overlap: bool = True,
        speculative: str = "off",
    ):
        """on_token(req, token, num_out): `token` is output number num_out of req (its output_ids[num_out - 1]);
        the callback finishes the request if it stops there (dropping any later placeholder: `drop_after`).
        speculative: "off", "ngram" or "mtp" (backends.common.core.speculative); speculation turns overlap off."""
        self.runner, self.sched, self.eos, self.on_token = runner, sched, eos_ids, on_token
        self.speculative = speculative
        self.overlap = overlap and speculative == "off"
        self._launched: LaunchedStep | None = None
        self.num_steps = 0
        self.num_overlapped = 0  # steps launched while the step before was still unread
        self.num_drafts = 0  # speculative: draft tokens verified
        self.num_accepted = 0  # of those, kept

    @property
    def pending(self) -> bool:
        return self._launched is not None

    # why the next schedule() reads the unread step first (`read_first`): a metric label each
    READ_FIRST = ("not_quiet", "room", "no_graph", "max_len", "sampling")

    def may_keep(self, busy: bool = False) -> bool:
        """Whether the next schedule() may run over the unread step (see the module's rules); `busy`: the caller
        has work of its own in flight that hands out slots (host copies)."""
        return self.read_first(busy) is None

    def read_first(self, busy: bool = False) -> str | None:
        """None where the next schedule() may run over the unread step (`may_keep`), else the first rule that
        does not hold, as one of READ_FIRST: not_quiet (requests that do not run, work in flight, or `busy`, and
        the scheduler not quiet), room (no free or evictable slot for every running request), no_graph (no
        captured graph for the batch), max_len (a request within a token of it), sampling (not greedy, or a banned
        token)."""
        s = self.sched
        others = {r.state for r in s.reqs.values()} - {ReqState.RUNNING}
        if (others or busy or s.inflight or s.orphans) and not s.quiet():
            return "not_quiet"  # beside requests that do not run, only while none of them can change
        running = [r for r in s.reqs.values() if r.state is ReqState.RUNNING]
        if s.pool.num_free + s.radix.evictable_size < len(running):
            return "room"
        if not self.runner.graph_batch(len(running)):
            return "no_graph"
        if not all(r.num_tokens + 1 < s.max_len for r in running):
            return "max_len"
        if not greedy_unbanned(running, self.eos):
            return "sampling"
        return None

    def step(self, reqs: list[InferReq]) -> None:
        """One decode token for each of reqs (each holds a reserved slot for it); speculating, a second one for
        each whose draft is verified."""
        if self.speculative != "off":
            self.num_steps += 1
            self._speculative_step(reqs)
            return
        if self.overlap and greedy_unbanned(reqs, self.eos):
            handle = self.runner.launch_greedy(self._spans(reqs))
            if handle is not None:
                launched = LaunchedStep(handle, [(r, len(r.output_ids)) for r in reqs])
                for r in reqs:
                    self.sched.after_decode(r, PENDING)
                self.num_steps += 1
                self.num_overlapped += self.pending
                self.flush()  # read step n while step n+1 runs
                self._launched = launched
                return
        self.flush()
        self.num_steps += 1
        for req, token in zip(reqs, next_tokens(self.runner, self._spans(reqs), reqs, self.eos)):
            self.sched.after_decode(req, token)
            self.on_token(req, token, len(req.output_ids))

    def flush(self) -> None:
        """Read the unread step's tokens into its requests' placeholders and report each (in batch order)."""
        launched, self._launched = self._launched, None
        if launched is None:
            return
        for (req, i), token in zip(launched.rows, self.runner.collect(launched.handle)):
            if req.state is not ReqState.RUNNING or req.output_ids[i] != PENDING:
                continue  # ended at the step before (its row here was computed for nothing)
            req.output_ids[i] = token
            self.on_token(req, token, i + 1)

    def _speculative_step(self, reqs: list[InferReq]) -> None:
        """Verify each request's draft (when it has one and a slot for it) in one forward pass; see the module
        doc of backends.common.core.speculative for why the tokens equal the non-speculative ones."""
        runner, state = self.runner, self.sched.state
        spans, drafts = [], []
        for i, r in enumerate(reqs):
            n = r.num_tokens
            d = r.draft if r.draft is not None and len(r.slots) > n else None
            save = runner.scratch_page(i) if d is not None and state is not None else -1
            toks = r.token_slice(n - 1, n) + ([d] if d is not None else [])
            spans.append(
                Span(toks, n - 1, r.slots, r.rid, r.state_page, logits_all=d is not None, save_page=save, mm=r.mm)
            )
            drafts.append(d)
        mtp = self.speculative == "mtp"
        # a hybrid model on the graph path verifies in a graph; a greedy batch's MTP head is launched right behind
        # it (on the verification's own argmax), so such a step waits for the device once
        graph = runner.launch_verify(spans)
        model = runner.model if graph else None
        mtp_graph = graph and mtp and bool(model.mtp_graphs)
        if graph and mtp and not mtp_graph:
            raise RuntimeError("speculative mtp: verification graphs without the MTP head's (prepare_speculative)")
        greedy = graph and greedy_unbanned(reqs, self.eos)
        hidden = None
        firsts, row = [], 0  # each span's first logits row on the eager path: its input's (a draft's follows)
        for d in drafts:
            firsts.append(row)
            row += 1 if d is None else 2
        if greedy:
            if mtp_graph:
                model.launch_mtp(None)
            toks = model.verify_argmax()
            t1 = [t[0] for t in toks]
            acc = [i for i, (d, t) in enumerate(zip(drafts, t1)) if d is not None and d == t]
            t2 = {i: toks[i][1] for i in acc}
        else:
            if graph:
                logits = model.verify_logits()
            elif mtp:
                logits, hidden = runner.forward_hidden(spans)
            else:
                logits = runner.forward(spans)
            t1 = sample_requests(logits[firsts], reqs, self.eos)
            acc = [i for i, (d, t) in enumerate(zip(drafts, t1)) if d is not None and d == t]
            t2 = dict(zip(acc, sample_requests(logits[[firsts[i] + 1 for i in acc]], [reqs[i] for i in acc],
                                               self.eos, ahead=[1] * len(acc)))) if acc else {}  # fmt: skip
        mtp_rows = []  # (batch index, tokens after the input)
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            if d is not None:
                self.num_drafts += 1
                if state is not None:  # roll back unless the draft survives: queued before anything caches it
                    state.copy(r.state_page, spans[i].save_page)
            self.sched.after_decode(r, t1[i])
            self.on_token(r, t1[i], len(r.output_ids))
            toks = [t1[i]]
            if i in t2 and r.state is ReqState.RUNNING:
                self.num_accepted += 1
                if state is not None:
                    state.written_elsewhere(r.state_page)  # the draft was right: keep the state past it
                self.sched.after_decode(r, t2[i])
                self.on_token(r, t2[i], len(r.output_ids))
                toks.append(t2[i])
            r.draft = None
            if r.state is ReqState.RUNNING:
                if mtp:
                    mtp_rows.append((i, toks))
                else:
                    r.draft = ngram_draft(r.all_ids)
        if not mtp_rows:
            return
        if mtp_graph:
            if not greedy:
                nexts: list[list[int] | None] = [None] * len(reqs)
                for i, toks in mtp_rows:
                    nexts[i] = toks
                model.launch_mtp(nexts)
            kept = [False] * len(reqs)
            for i, toks in mtp_rows:
                kept[i] = len(toks) == 2
            new = model.mtp_drafts(kept)
            for i, _ in mtp_rows:
                reqs[i].draft = new[i]
            return
        mspans, hrows = [], []
        for i, toks in mtp_rows:
            r = reqs[i]
            mspans.append(Span(toks, r.num_tokens - 1 - len(toks), r.slots, r.rid, mm=r.mm))
            hrows.extend(firsts[i] + j for j in range(len(toks)))
        for (i, _), d in zip(mtp_rows, runner.mtp_logits(mspans, hidden[hrows]).argmax(dim=-1).tolist()):
            reqs[i].draft = int(d)

    def drop(self) -> None:
        """Forget the unread step (the loop failed its requests)."""
        self._launched = None

    @staticmethod
    def _spans(reqs: list[InferReq]) -> list[Span]:
        return [
            Span(r.token_slice(r.num_tokens - 1, r.num_tokens), r.num_tokens - 1, r.slots, r.rid, r.state_page, mm=r.mm)
            for r in reqs
        ]


def drop_after(req: InferReq, num_out: int) -> None:
    """A request that stops at output num_out keeps no placeholder of a step launched after that token."""
    del req.output_ids[num_out:]
