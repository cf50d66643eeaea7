"""ModelRunner: the only piece that touches a device. It owns the weights and the KV store, turns scheduled
(token ids, start position, slots) spans into one ragged ForwardBatch, and returns logits."""

from __future__ import annotations

import os
import sys

import torch

from backends.common.engine.tp_ranks import FORWARD, STATE_OPS, encode_spans
from backends.common.model import loader
from backends.common.model.batch import Span, build_batch
from backends.common.model.kv_store import KVStore, StateStore
from backends.common.model.model import LlamaModel

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


def set_cpu_threads(n: int) -> None:
    """A served instance's torch threads (its config's cpu_threads; the launcher divides the cores among the
    prefill and decode instances). 0 keeps torch's default."""
    if n > 0:
        torch.set_num_threads(n)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


BACKENDS = ("auto", "triton", "torch")


def pick_backend(backend: str, device: torch.device) -> str:
    """auto: the Triton kernels with CUDA graphs on a CUDA device when triton imports, else plain PyTorch. The
    environment variable TRITON_PD_BACKEND overrides the argument (for every model of a server); with
    TRITON_INTERPRET=1, `triton` also runs on the CPU, through Triton's interpreter (debugging without a GPU)."""
    backend = os.environ.get("TRITON_PD_BACKEND", backend)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    import kernels

    if not kernels.available() or device.type != "cuda":
        if backend == "triton":
            raise ValueError("backend 'triton' needs a CUDA device and the triton package")
        return "torch"
    return "triton"


def default_state_pages(max_batch: int) -> int:
    """State pages of a hybrid model when not given: one live page per request of a full batch, as many again
    for prefix-cache checkpoints (paused requests' states among them), and a few spare."""
    return 2 * max_batch + 8


def state_pages_within(pages: int, budget: int, page_bytes: int, max_batch: int, floor: int = 16) -> int:
    """A hybrid model's default state pages on a GPU, cut to what `budget` bytes hold beside the scratch page each
    batch row keeps (and the graphs' padding page): the full-batch default of 2 x max_batch + 8 pages of
    Qwen3.5-9B's 49 MiB is 38 GiB with its scratch, more than an 80 GB card has left once both roles' weights are
    loaded. At least `floor` (or `pages`, if fewer) whatever the budget: fewer pages only run fewer requests at
    once, no page at all runs none."""
    fit = max(0, budget) // max(1, page_bytes) - max_batch - 1
    return min(pages, max(fit, floor))


class ModelRunner:
    def __init__(
        self,
        model_spec: str,
        dtype: str = "float32",
        device: str | None = None,
        kv_tokens: int = 16384,
        kv_shm_name: str | None = None,
        backend: str = "auto",
        max_batch: int = 256,
        cuda_graphs: bool = True,
        state_pages: int | None = None,
        state_shm_name: str | None = None,
        deterministic: bool = False,
        graph_sizes: tuple[int, ...] = GRAPH_SIZES,
        vision: bool = False,
        quantization: str = "",
        memory_fraction: float | None = None,
        tp: int = 1,
        tp_rank: int = 0,
    ):
        """deterministic: batch-invariant kernels on the GPU path (kernels.invariant; dense models only: a hybrid
        model on the GPU path is refused with loader.ModelError). The CPU path is exact without them.
        graph_sizes: the decode batch sizes captured in CUDA graphs on the GPU path (a batch runs in the smallest
        one that holds it; each is tuned at capture); the default serves every batch up to 512.
        vision: also load a multimodal checkpoint's vision tower and image processor (`self.vision`,
        `self.images`; None for a text-only model): the prefill side and the offline engine. Decode never does.
        quantization: "fp8" converts a 16-bit checkpoint's projections to fine-grained FP8 at load (an FP8
        checkpoint or a random `-fp8` shape is FP8 without it): backends/common/model/fp8.py.
        memory_fraction (a CUDA device, a hybrid model, state_pages not given): the state pages are cut so that this
        process's weights, KV pool and state pages stay within this fraction of the GPU's memory
        (`state_pages_within`); decode passes its --kv-memory-fraction.
        tp: tensor parallelism over that many ranks, one process each (the PyTorch path, CPU, for now): this
        process is rank 0 and starts the others (backends/common/engine/tp_ranks.py), every forward broadcasts its
        spans to them, and each rank holds its shard, K/V heads and state pages; `close()` stops them. tp_rank: a
        worker rank's own (tp_worker.main passes it; it starts nothing)."""
        self.device = torch.device(device or default_device())
        self.dtype = parse_dtype(dtype)
        self.source = loader.resolve(model_spec)
        self.cfg = loader.load_config(self.source)
        self.ranks = None  # rank 0 of a tensor-parallel instance: its workers (tp_ranks.Ranks)
        self.kv_shm_name = kv_shm_name
        self._shards: list | None = None  # kv_shards(): every rank's store, rank 0's view of them
        self.tp = self._start_ranks(model_spec, dtype, kv_tokens, max_batch, state_pages, quantization, backend,
                                    vision, tp, tp_rank, kv_shm_name, state_shm_name)  # fmt: skip
        if self.tp is not None:  # this rank's own segments
            from backends.common.model.kv_store import shard_name

            kv_shm_name = shard_name(kv_shm_name, tp_rank) if kv_shm_name else None
            state_shm_name = shard_name(state_shm_name, tp_rank) if state_shm_name else None
        self.tokenizer = loader.load_tokenizer(self.source)
        self.quantization = quantization or self.cfg.quantization
        if self.quantization and self.device.type == "cpu" and self.dtype == torch.float32:
            # FP8 on the CPU computes in float64: quantizing activations turns the last-bit differences of a sum
            # that depends on the batch into whole e4m3 steps, and a paused answer recomputed or continued in
            # another batch would then differ from the unpaused one at a near tie (float32 crossed a step about
            # once in a few hundred tokens of the tiny test models; float64's differences practically never do)
            self.dtype = torch.float64
        weights = loader.load_weights(self.source, self.dtype, self.device, self.cfg, quantization)
        if self.quantization and deterministic and pick_backend(backend, self.device) == "triton":
            raise loader.ModelError(
                f"{model_spec}: deterministic mode covers 16-bit and float32 weights; FP8 weights are not covered"
            )
        self.vision_missing = "it has no vision tower: text only"  # why `vision` is None, for a refusal
        self.vision, self.images = self._load_vision() if vision and self.tp is None else (None, None)
        cfg = self.cfg
        self.state: StateStore | None = None
        self.num_state_pages = 0
        self.hybrid = None  # hybrid models: the eager HybridModel (also inside GpuHybrid)
        if cfg.is_hybrid:
            if deterministic and pick_backend(backend, self.device) == "triton" and self.device.type == "cuda":
                raise loader.ModelError(
                    f"{model_spec}: deterministic mode covers dense models; hybrid (linear-attention) models are not "
                    "covered yet on the GPU"
                )
            self._init_hybrid(weights, kv_tokens, kv_shm_name, backend, max_batch, cuda_graphs, state_pages,
                              state_shm_name, graph_sizes, memory_fraction)  # fmt: skip
            return
        self.backend = pick_backend(backend, self.device)
        if self.tp is not None:
            from backends.common.model.tensor_parallel import shard_llama

            cfg, weights = shard_llama(cfg, weights, self.tp)
        # the GPU path keeps one extra slot that padded graph rows read and write
        extra = 1 if self.backend == "triton" else 0
        self.kv = KVStore.allocate(
            cfg.num_layers, kv_tokens + extra, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
            shm_name=kv_shm_name,
        )  # fmt: skip
        self.num_slots = kv_tokens
        if self.backend == "triton":
            from backends.common.model.gpu_model import GpuLlama

            self.model = GpuLlama(
                cfg, weights, self.kv, scratch_slot=kv_tokens, max_batch=max_batch,
                graph_sizes=None if not cuda_graphs else graph_sizes, deterministic=deterministic,
            )  # fmt: skip
        else:
            self.model = LlamaModel(cfg, weights, tp=self.tp)
        self._ready()

    def _ready(self) -> None:
        """Tensor parallelism: every rank has its shard and stores once this returns (a barrier of all ranks;
        a worker that died loading fails rank 0 here, naming it)."""
        if self.tp is None:
            return
        import torch.distributed as dist

        try:
            dist.barrier()
        except RuntimeError as e:
            if self.ranks is None:
                raise
            raise self.ranks.error(e) from e

    def kv_shards(self) -> list[tuple[KVStore, int, int]]:
        """Every rank's KV store with the KV heads [lo, hi) it holds, in rank order (rank 0 maps the workers'
        shared-memory pools by name); one entry, all heads, without tensor parallelism."""
        if self.tp is None:
            return [(self.kv, 0, self.kv.num_kv_heads)]
        if self._shards is None:
            from backends.common.model.kv_store import SharedFile, shard_name, tensor_on

            if self.tp.rank != 0 or not self.kv_shm_name:
                raise ValueError("kv_shards: rank 0 of a tensor-parallel runner with a kv_shm_name")
            per = self.kv.num_kv_heads
            shards = [(self.kv, 0, per)]
            for r in range(1, self.tp.size):
                shm = SharedFile(shard_name(self.kv_shm_name, r))
                shards.append((KVStore(tensor_on(shm.map, self.kv.buffer.dtype, self.kv.buffer.shape), shm),
                               r * per, (r + 1) * per))  # fmt: skip
            self._shards = shards
        return self._shards

    def _start_ranks(self, model_spec, dtype, kv_tokens, max_batch, state_pages, quantization, backend, vision, tp,
                     tp_rank, kv_shm_name=None, state_shm_name=None):  # fmt: skip
        """This rank's TPGroup (None without tensor parallelism); rank 0 starts the workers first, so that they
        load their shards while it loads its own."""
        if tp <= 1:
            return None
        from backends.common.model.tensor_parallel import TPGroup, check

        if self.device.type != "cpu" or pick_backend(backend, self.device) != "torch":
            raise loader.ModelError(
                f"tp: tensor parallelism runs on the PyTorch path (device cpu, backend torch) so far, not on "
                f"{self.device.type} with the {pick_backend(backend, self.device)} backend"
            )
        check(self.cfg, tp)
        if tp_rank == 0:
            from backends.common.engine.tp_ranks import Ranks

            args = ["--model", model_spec, "--dtype", dtype, "--kv-tokens", str(kv_tokens), "--max-batch",
                    str(max_batch), "--state-pages", str(state_pages or 0), "--quantization", quantization,
                    "--threads", str(torch.get_num_threads())]  # fmt: skip
            shm = [n for n in (kv_shm_name, state_shm_name) if n]
            if kv_shm_name:
                args += ["--kv-shm-name", kv_shm_name]
            if state_shm_name:
                args += ["--state-shm-name", state_shm_name]
            self.ranks = Ranks(tp, args, shm_names=shm)
        return TPGroup(tp_rank, tp)

    def close(self) -> None:
        """Stop a tensor-parallel instance's workers and remove their shared-memory pools (nothing otherwise)."""
        for store, _, _ in (self._shards or [])[1:]:
            store.close()
        self._shards = None
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def _load_vision(self):
        """(VisionTower, ImageProcessor) of a multimodal checkpoint folder, (None, None) for a text-only model."""
        from backends.common.model.multimodal import image_processor_for
        from backends.common.model.vision import VisionTower, random_vision_weights

        images, why = image_processor_for(self.source)
        if images is None:
            if why != self.vision_missing:  # a tower that cannot be fed: say so once at load
                self.vision_missing = why
                print(f"[triton-pd] {self.source.spec}: {why}; serving text only", file=sys.stderr)
            return None, None
        if self.source.folder is None:  # a random shape's tower
            return VisionTower(images.vc, random_vision_weights(images.vc, self.dtype, self.device)), images
        return VisionTower.load(self.source.folder, self.dtype, self.device), images

    def _init_hybrid(self, weights, kv_tokens, kv_shm_name, backend, max_batch, cuda_graphs, state_pages,
                     state_shm_name, graph_sizes, memory_fraction=None):  # fmt: skip
        """A hybrid model: K/V for its full-attention layers (and the MTP head's), a state page per running
        request and per cache checkpoint. The gated delta rule runs in the Triton kernels where the backend would
        pick Triton (a CUDA device with triton, or `triton` with TRITON_INTERPRET=1 on the CPU); there decode
        batches also replay CUDA graphs (`gpu_hybrid.GpuHybrid`, MoE layers included), and `backend`
        reads "triton". Otherwise plain PyTorch layers, and `backend` reads "torch"."""
        from backends.common.model import gpu_hybrid
        from backends.common.model.hybrid_model import HybridModel

        kernels = pick_backend(backend, self.device) == "triton"
        cfg = self.cfg
        if self.tp is not None:
            from backends.common.model.hybrid_model import fuse_weights
            from backends.common.model.tensor_parallel import shard_hybrid

            fuse_weights(cfg, weights)
            cfg, weights = shard_hybrid(cfg, weights, self.tp)
        self.hybrid = HybridModel(cfg, weights, kernels=kernels, tp=self.tp)
        # FP8 hybrids run the eager layers (kernels.fp8's products, MoE experts in kernels.moe's W8A8 grouped
        # GEMMs): the decode graphs' fused projections read 16-bit weights
        graphs = kernels and cuda_graphs and gpu_hybrid.supports(self.cfg) and not self.hybrid.quantized
        # the graph path keeps one extra KV slot and one extra state page that padded graph rows write
        self.kv = KVStore.allocate(
            self.hybrid.num_kv_layers, kv_tokens + int(graphs), cfg.num_kv_heads, cfg.head_dim, self.dtype,
            self.device, shm_name=kv_shm_name,
        )  # fmt: skip
        self.num_slots = kv_tokens
        self.num_state_pages = state_pages or default_state_pages(max_batch)
        if not state_pages and memory_fraction and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = int(memory_fraction * total) - torch.cuda.memory_allocated(self.device)  # less weights and KV
            pages = state_pages_within(self.num_state_pages, budget, self.cfg.state_page_bytes(), max_batch)
            if pages < self.num_state_pages:
                print(f"[triton-pd] {self.source.spec}: {pages} state pages, not {self.num_state_pages}: the weights, "
                      f"KV pool and state pages within {memory_fraction:g} of the GPU's memory "
                      "(--state-pages sets them)", file=sys.stderr)  # fmt: skip
                self.num_state_pages = pages
        # the pages the scheduler hands out, then one scratch page per batch row for speculative steps' rollback
        # (and the graph rows' padding page)
        scratch = self.num_state_pages + max_batch
        self.state = StateStore.allocate(cfg, scratch + int(graphs), self.device, shm_name=state_shm_name)
        if graphs:
            self.backend = "triton"
            self.model = gpu_hybrid.GpuHybrid(
                self.hybrid, self.kv, self.state, scratch_slot=kv_tokens, pad_page=scratch, max_batch=max_batch,
                graph_sizes=graph_sizes,
            )  # fmt: skip
        else:
            self.backend = "torch"
            self.model = self.hybrid
        self._ready()

    @property
    def has_mtp(self) -> bool:
        return self.hybrid is not None and self.hybrid.has_mtp

    def scratch_page(self, row: int) -> int:
        """A hybrid model's scratch state page for batch row `row` (outside the scheduler's pages)."""
        return self.num_state_pages + row

    def forward_hidden(self, spans: list[Span]):
        """(logits, final-norm hidden states) of the spans' logits rows: hybrid models only (the MTP head's input)."""
        self._single_rank("the MTP head")
        return self.hybrid.forward_hidden(build_batch(spans, self.device), self.kv, self.state)

    def mtp_logits(self, spans: list[Span], hidden) -> torch.Tensor:
        """The MTP head over spans whose tokens are the main model's next tokens (see HybridModel.mtp_logits)."""
        return self.hybrid.mtp_logits(build_batch(spans, self.device), hidden, self.kv)

    def prepare_speculative(self, mode: str) -> None:
        """Decode speculates (`backends.common.core.speculative`): a hybrid model on the graph path captures its
        verification graphs (and its MTP head's, for mode "mtp"), so speculative steps do not run eagerly."""
        if mode != "off":
            self._single_rank("speculative decoding")
        if mode != "off" and self.hybrid is not None and self.backend == "triton":
            self.model.capture_speculative(mtp=mode == "mtp")

    def launch_verify(self, spans: list[Span]) -> bool:
        """Replay the verification graph for a speculative step (spans of an input token and at most one draft);
        False where the step runs eagerly. The launched step's results: `model.verify_logits()`,
        `model.verify_argmax()`, then `model.launch_mtp(...)` and `model.mtp_drafts(...)`."""
        return self.hybrid is not None and self.backend == "triton" and self.model.launch_verify(spans)

    def apply_state_ops(self, ops: list[tuple[int, int]]) -> None:
        """Run the state-page copies the scheduler queued (see StatePages), before anything reads the pages."""
        if ops:
            if self.ranks is not None:
                self.ranks.send(STATE_OPS, torch.tensor(ops, dtype=torch.int64).flatten())
            self.state.apply(ops)

    def _single_rank(self, what: str) -> None:
        if self.tp is not None:
            raise loader.ModelError(f"tp: {what} does not run with tensor parallelism yet")

    def forward(self, spans: list[Span]) -> torch.Tensor:
        """float32 logits [len(spans), vocab]: the next-token logits after each span's last token."""
        if self.ranks is None:
            return self.forward_local(spans)
        self.ranks.send(FORWARD, encode_spans(spans))
        try:
            return self.forward_local(spans)
        except RuntimeError as e:  # a collective inside the step: a worker gone or stuck
            raise self.ranks.error(e) from e

    def forward_local(self, spans: list[Span]) -> torch.Tensor:
        """forward on this rank alone (a worker rank's step; with tp, the other ranks must run it too)."""
        if self.backend == "triton":
            return self.model.forward(spans)
        if self.state is not None:
            return self.model.forward(build_batch(spans, self.device), self.kv, self.state)
        return self.model.forward(build_batch(spans, self.device), self.kv)

    def greedy(self, spans: list[Span]) -> list[int] | None:
        """The argmax token after each span when the GPU path can produce it inside a decode graph, else None."""
        return self.model.greedy(spans) if self.backend == "triton" else None

    def graph_batch(self, n: int) -> bool:
        """Whether a decode batch of n sequences replays a captured graph (GPU path)."""
        return self.backend == "triton" and self.model.fits_graph(n)

    def launch_greedy(self, spans: list[Span]):
        """Start a greedy graph step without waiting for its tokens (span ids of -1: see `GpuLlama.launch_greedy`);
        a handle for `collect`, or None when the batch cannot run that way (CPU path, not a graph batch)."""
        return self.model.launch_greedy(spans) if self.backend == "triton" else None

    def collect(self, handle) -> list[int]:
        return self.model.collect(handle)

    def forget(self, key) -> None:
        """The request `key` is done: the GPU path may reuse its slot-table row (it would evict it anyway)."""
        if self.backend == "triton":
            self.model.forget(key)
