"""Qwen3.5 with images on the CPU, against transformers: the vision tower's rows, the multimodal rotary positions,
and greedy answers with one image and with two images of different sizes, token for token (dense and MoE
checkpoints saved with `save_pretrained`, with the image processor beside them)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from backends.common.core.request import ParamError, SamplingParams
from tests.hybrid.conftest import MOE_3_5, TEXT_3_5, VISION_3_5, long_memory, make_engine

# the tiny vocabulary's last ids stand for Qwen3.5's vision tokens
IDS = dict(image_token_id=300, vision_start_token_id=301, vision_end_token_id=302, video_token_id=303)
IMAGE, START, END = IDS["image_token_id"], IDS["vision_start_token_id"], IDS["vision_end_token_id"]
# patches of 14 pixels merged 2 x 2: images become multiples of 28 pixels a side, from 4 to 64 merged tokens
PROCESSOR = dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)


def _save(tmp_path_factory, moe: bool):
    import transformers as tf

    torch.manual_seed(3 if moe else 2)
    if moe:
        text = {k: v for k, v in TEXT_3_5.items() if k != "intermediate_size"}
        hf = tf.Qwen3_5MoeForConditionalGeneration(
            tf.Qwen3_5MoeConfig(text_config={**text, **MOE_3_5}, vision_config=VISION_3_5, **IDS)
        )
    else:
        hf = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=TEXT_3_5, vision_config=VISION_3_5, **IDS))
    hf = hf.float().eval()
    long_memory(hf)
    with torch.no_grad():  # the tower's norms and position table away from their init, so a slip shows
        for name, p in hf.named_parameters():
            if "visual" in name and ("norm" in name or "pos_embed" in name):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("tiny-qwen3.5-vl-moe" if moe else "tiny-qwen3.5-vl")
    hf.save_pretrained(folder)
    tf.Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module", params=["dense", "moe"])
def saved(request, tmp_path_factory):
    return _save(tmp_path_factory, request.param == "moe")


@pytest.fixture(scope="module")
def engine(saved):
    return make_engine(saved[0])


def png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def hf_inputs(engine, ids: list[int], images: list[bytes]) -> dict:
    """transformers' inputs for the same request: the expanded ids, the processor's pixels and grids, and which
    tokens are image tokens."""
    exp, mm = engine.prepare_images(ids, images)
    return dict(
        input_ids=torch.tensor([exp]),
        pixel_values=torch.cat([im.pixel_values for im in mm.images]),
        image_grid_thw=torch.tensor([im.grid_thw for im in mm.images]),
        mm_token_type_ids=(torch.tensor([exp]) == IMAGE).int(),
    ), mm


def hf_greedy_mm(hf, inputs: dict, n: int) -> list[int]:
    """Greedy decoding with transformers' own cache and no EOS stop; the first call sees the images (and sets the
    model's rope delta, which its later steps add)."""
    out_ids = []
    with torch.no_grad():
        out = hf(**inputs, use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            out = hf(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def test_vision_tower_equals_transformers(engine, saved):
    _, hf = saved
    tower = engine.runner.vision
    grid = torch.tensor([[1, 4, 6], [1, 8, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), tower.vc.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.model.visual(pixels, grid_thw=grid).pooler_output
    got = tower.encode(pixels, grid)
    assert [g.shape[0] for g in got] == [6, 8]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)


def test_multimodal_positions_equal_transformers_rope_index(engine, saved):
    _, hf = saved
    ids = [5, 6, START, IMAGE, END, 7, 8, 9, START, IMAGE, END, 10]
    inputs, mm = hf_inputs(engine, ids, [png(56, 112, 1), png(140, 84, 2)])
    want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert torch.equal(mm.positions_3d, want[:, 0]) and mm.delta == int(delta)
    assert mm.delta < 0  # the images' tokens outnumber the positions they take
    n = mm.prompt_len
    assert torch.equal(mm.positions(n, n + 3), (torch.arange(n, n + 3) + mm.delta).expand(3, -1))


@pytest.mark.parametrize("sizes", [[(84, 56)], [(56, 112), (140, 84)]], ids=["one-image", "two-images"])
def test_greedy_with_images_equals_transformers(engine, saved, sizes):
    _, hf = saved
    images = [png(w, h, 10 + i) for i, (w, h) in enumerate(sizes)]
    ids = [7, 8] + [t for _ in images for t in (START, IMAGE, END)] + [11, 12, 13]
    inputs, _ = hf_inputs(engine, ids, images)
    ref = hf_greedy_mm(hf, inputs, 12)
    out = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), images=[images])[0]
    assert out.output_ids == ref
    assert out.num_prompt_tokens == inputs["input_ids"].shape[1]


def test_grids_without_pixels_equal_the_processors(engine):
    """Master expands prompts from each image's grid and digest alone (pixels=False: the processor's resize rule,
    no pixels made); they equal what preprocessing gives, for sizes that resize up, down and to odd aspects."""
    proc = engine.runner.images
    sizes = [(56, 56), (224, 224), (300, 97), (97, 300), (640, 480), (1000, 17)]
    images = [png(w, h, i) for i, (w, h) in enumerate(sizes)]
    full = [im for x in images for im in proc([x])]
    quick = [im for x in images for im in proc([x], pixels=False)]
    assert [im.grid_thw for im in quick] == [im.grid_thw for im in full]
    assert [im.digest for im in quick] == [im.digest for im in full]
    assert all(im.pixel_values.numel() == 0 for im in quick) and all(im.pixel_values.numel() for im in full)


def test_the_cache_keys_image_tokens_by_content(engine):
    """The same text with image A, then with image B, gives B's own answer (B alone, from an empty cache): every
    image's tokens have the same id, and a cache keyed by ids would give B the K/V and state of A's image. The same
    image again is served from the cache. A request's images are encoded once."""
    ids = [7, START, IMAGE, END, 11, 12]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # 224 x 224: 64 image tokens, so the prompt passes the first prefill chunk (64) inside the image, where the
    # cache keeps a state checkpoint that a request with the same ids (not the same image) would hit
    a, b = png(224, 224, 20), png(224, 224, 21)
    engine.scheduler.radix.clear()
    b_alone = engine.generate([ids], params, images=[[b]])[0].output_ids
    engine.scheduler.radix.clear()
    ra = engine.add_request(ids, params, [a])
    while engine.has_work():
        engine.step()
    assert ra.mm.encodes == 1 and ra.output_ids != b_alone  # the image is read: another picture, another answer
    cached = engine.scheduler.num_cached_tokens
    assert engine.generate([ids], params, images=[[b]])[0].output_ids == b_alone
    assert engine.scheduler.num_cached_tokens == cached  # B found nothing of A's image to reuse
    assert engine.generate([ids], params, images=[[a]])[0].output_ids == ra.output_ids
    assert engine.scheduler.num_cached_tokens > cached  # A again: its image's K/V and state from the cache


@pytest.mark.parametrize(
    "ids,images,match",
    [
        ([7, START, IMAGE, END], [], None),  # no images: the placeholder stays a token of the prompt
        ([7, 8], ["png"], "image: 1 image"),
        ([7, START, IMAGE, END], ["!!notbase64"], "image\\[0\\]: not valid base64"),
        ([7, START, IMAGE, END], [base64.b64encode(b"GIF89a")], "image\\[0\\]: not a decodable"),
    ],
    ids=["none", "no-placeholder", "bad-base64", "not-an-image"],
)
def test_bad_images_name_the_input(engine, ids, images, match):
    images = [png(56, 56, 0) if x == "png" else x for x in images]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    if match is None:
        assert len(engine.generate([ids], params, images=[images])[0].output_ids) == 2
        return
    with pytest.raises(ParamError, match=match):
        engine.add_request(ids, params, images)
    assert not engine.has_work()


def test_a_text_only_model_refuses_images(hybrid_folder):
    eng = make_engine(hybrid_folder)
    with pytest.raises(ParamError, match="image: .* takes no images: it has no vision tower"):
        eng.add_request([7, 8], SamplingParams(max_tokens=2), [png(56, 56, 0)])


def _word_tokenizer(folder) -> None:
    """A tokenizer for the tiny checkpoint: words t0..t299, Qwen3.5's three vision tokens at their ids, and a chat
    template that wraps the user's text in t1 ... t2."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vision = {"<|image_pad|>": IMAGE, "<|vision_start|>": START, "<|vision_end|>": END}
    vocab = {f"t{i}": i for i in range(300)} | vision
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(vision))
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}t1 {{ m['content'] }} t2{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))


@pytest.mark.parametrize("chat", [False, True], ids=["placeholder-in-text", "chat-puts-it-first"])
def test_generate_offline_takes_image_files(engine, saved, tmp_path, capsys, chat):
    """`triton-pd generate --offline --image FILE`: the answer equals the engine's for the same ids and image; with
    --chat and no placeholder in the text the image goes before the user's text."""
    import json

    from backends.cli import main

    folder, _ = saved
    _word_tokenizer(folder)
    image = tmp_path / "a.png"
    image.write_bytes(png(84, 56, 30))
    text = "t7 t8" if chat else "t7 t8 <|vision_start|><|image_pad|><|vision_end|> t11"
    argv = ["generate", "--offline", "--model", str(folder), "--prompt", text, "--image", str(image),
            "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--json"]  # fmt: skip
    argv += ["--chat"] if chat else []
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["output_ids"]
    ids = [1, START, IMAGE, END, 7, 8, 2] if chat else [7, 8, START, IMAGE, END, 11]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert got == engine.generate([ids], params, images=[[image.read_bytes()]])[0].output_ids
    # a missing file is named (offline and against a server: tests/server/test_images.py)
    assert main(argv[:6] + ["--image", str(tmp_path / "none.png")]) == 2
    assert "none.png: No such file" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["qwen3.5-9b", "qwen3.5-35b-a3b"])
def test_random_qwen3_5_shapes_have_the_published_tower(shape):
    """random:qwen3.5-9b and -35b-a3b take images: the published tower's shape (its rows as wide as the language
    model), Qwen3-VL's image processor (patches of 16), random weights the tower loads (checked on a reduced depth
    and width here: the full tower is 0.4 B parameters)."""
    from dataclasses import replace

    from backends.common.core.config import SHAPES
    from backends.common.model.loader import resolve
    from backends.common.model.multimodal import image_processor_for
    from backends.common.model.vision import VisionTower, random_vision_weights, vision_config_of

    src = resolve(f"random:{shape}")
    vc = vision_config_of(src)
    assert (vc.depth, vc.hidden_size, vc.patch_size, vc.out_hidden_size) == (27, 1152, 16, SHAPES[shape].hidden_size)
    proc, why = image_processor_for(src)
    assert why == "" and proc.vc == vc
    image = proc([png(64, 96, 5)])[0]
    assert image.pixel_values.shape == (image.grid_thw[1] * image.grid_thw[2], vc.patch_dim) and image.grid_thw == (
        1,
        6,
        4,
    )
    small = replace(vc, depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48)
    tower = VisionTower(small, random_vision_weights(small, torch.float32, "cpu"))
    (rows,) = tower.encode(image.pixel_values, torch.tensor([image.grid_thw]))
    assert rows.shape == (6, 48) and torch.isfinite(rows).all()


def test_a_processor_that_cannot_be_imported_leaves_text_served(monkeypatch):
    """transformers or Pillow missing or too old on the host: the model is served text only, and why is said (the
    message master refuses images with, and the runner's line at load)."""
    import builtins

    from backends.common.model.loader import resolve
    from backends.common.model.multimodal import image_processor_for

    real = builtins.__import__

    def no_pil_backend(name, *args, **kwargs):
        if name.startswith("transformers.models.qwen2_vl"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil_backend)
    proc, why = image_processor_for(resolve("random:qwen3.5-9b"))
    assert proc is None and "cannot be imported" in why and "ModuleNotFoundError" in why


def test_the_tower_keeps_each_grids_layout_and_gives_the_same_rows():
    """The second encode of the same image sizes reuses the first's position taps and rotary tables: same rows."""
    from dataclasses import replace

    from backends.common.model.loader import resolve
    from backends.common.model.vision import VisionTower, random_vision_weights, vision_config_of

    vc = replace(vision_config_of(resolve("random:qwen3.5-9b")), depth=1, hidden_size=32, intermediate_size=64,
                 num_heads=2, out_hidden_size=48)  # fmt: skip
    tower = VisionTower(vc, random_vision_weights(vc, torch.float32, "cpu"))
    grid = torch.tensor([[1, 6, 4], [1, 4, 4]])
    x = torch.randn(int(grid.prod(-1).sum()), vc.patch_dim)
    first = tower.encode(x, grid)
    assert list(tower._layouts) == [((1, 6, 4), (1, 4, 4))]
    again = tower.encode(x, grid)
    assert len(tower._layouts) == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    (alone,) = tower.encode(x[:24], grid[:1])  # another key; the first image's rows do not depend on the second's
    assert len(tower._layouts) == 2 and torch.allclose(alone, first[0], atol=1e-5)
