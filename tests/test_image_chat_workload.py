"""The image-chat workload (pagedjax/workloads/image_chat.py): each family's image-token
rule against transformers' own image processors, and the generator's shapes."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.workloads.image_chat import FAMILIES, IMAGE_SIZES, idefics3_tiles, image_chat

ODD_SIZES = ((300, 200), (200, 300), (5000, 100), (364, 364), (365, 100), (57, 57))


@pytest.mark.tier2  # importing transformers' processors takes ~20 s (torch)
def test_idefics3_and_smolvlm_tiles_match_the_processor():
    pil = pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")
    for longest, tile in ((1456, 364), (1536, 384)):
        proc = pil.Idefics3ImageProcessorPil(
            size={"longest_edge": longest}, max_image_size={"longest_edge": tile}
        )
        for w, h in IMAGE_SIZES + ODD_SIZES:
            _, rows, cols = proc.get_number_of_image_patches(h, w)
            assert idefics3_tiles(h, w, longest, tile) == (rows, cols), (w, h)


@pytest.mark.tier2
def test_qwen2vl_tokens_match_the_processor():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    proc = pil.Qwen2VLImageProcessorPil()
    for w, h in IMAGE_SIZES + ODD_SIZES:
        patches = proc.get_number_of_image_patches(h, w)  # 14-px patches before the 2x2 merge
        assert FAMILIES["qwen2-vl"].image_tokens(w, h) == patches // 4 + 2, (w, h)


# What the processors give for IMAGE_SIZES (transformers 5.25; the tier2 tests above
# recompute it from them): Idefics3 / SmolVLM (rows, cols) and Qwen2-VL tokens.
PROCESSOR_TILES = [(3, 4), (4, 3), (3, 4), (3, 4), (3, 4), (3, 4), (3, 4), (4, 4), (4, 4)]
QWEN2VL_TOKENS = [1232, 1232, 1224, 1198, 1001, 611, 393, 1227, 326]


def test_rules_give_the_processors_counts():
    for (w, h), tiles, q in zip(IMAGE_SIZES, PROCESSOR_TILES, QWEN2VL_TOKENS, strict=True):
        assert idefics3_tiles(h, w, 1456, 364) == tiles == idefics3_tiles(h, w, 1536, 384)
        assert FAMILIES["qwen2-vl"].image_tokens(w, h) == q
    assert idefics3_tiles(100, 5000, 1456, 364) == (1, 4)
    assert idefics3_tiles(300, 300, 364, 364) == (0, 0)  # one tile: not split


def test_idefics3_prompt_text_count():
    # 3 x 4 tiles: 12 x (169 + fake + row_col) + 3 row newlines + "\n" + fake + global
    # tag + 169 + fake.
    assert FAMILIES["idefics3"].image_tokens(1024, 768) == 12 * 171 + 3 + 1 + 3 + 169
    assert FAMILIES["llava-1.5"].image_tokens(4032, 3024) == 576


def test_image_chat_shapes_determinism_and_refusals():
    w = image_chat("llava-1.5", 2.0, num_requests=400, seed=3, max_len=4096)
    again = image_chat("llava-1.5", 2.0, num_requests=400, seed=3, max_len=4096)
    assert np.array_equal(w.prompt_len, again.prompt_len)
    assert np.array_equal(w.arrival_time, again.arrival_time)
    assert w.name == "image_chat:llava-1.5" and w.source_len == 4096
    assert np.all(w.total_len <= 4096) and np.all(w.output_len >= 1)
    # Text prompts are 4..1024 tokens (mean ~161), 1-4 images of 576 (mean 2.5).
    assert w.prompt_len.min() >= 576 + 4 and w.prompt_len.max() <= 4 * 576 + 1024
    assert w.prompt_len.min() < 2 * 576 and w.prompt_len.max() > 4 * 576
    assert 0.85 < w.prompt_len.mean() / (161.3 + 2.5 * 576) < 1.15
    q = image_chat("qwen2-vl", 1.0, duration_s=60.0, seed=0, max_len=8192)
    assert 30 < len(q) < 100 and np.all(q.total_len <= 8192)
    idf = image_chat("idefics3", 1.0, num_requests=50, seed=0, max_len=8192)
    assert np.all(idf.total_len <= 8192)
    with pytest.raises(ValueError, match="family"):
        image_chat("llava-2", 1.0, num_requests=1)
    with pytest.raises(ValueError, match="images"):
        image_chat("llava-1.5", 1.0, num_requests=1, images=(0, 2))
    with pytest.raises(ValueError, match="exactly one"):
        image_chat("llava-1.5", 1.0)
    with pytest.raises(ValueError, match="image size"):
        FAMILIES["smolvlm"].image_tokens(0, 10)


@pytest.mark.slow  # four simulators compiled for a 4,096-token context (~40 s on 2 cores)
def test_memory_waste_images_experiment(tmp_path):
    from experiments import memory_waste_images
    from experiments.config import ExperimentConfig, ImageWasteSettings
    from pagedjax.config import ConfigError

    s = ImageWasteSettings(family="llava-1.5", rate=2.0, duration_s=40.0)
    cfg = ExperimentConfig(experiments=["memory_waste_images"], memory_waste_images=s)
    out = memory_waste_images.run(cfg, tmp_path, lambda it, **_: it)
    assert out["setup"]["max_model_len"] == 4096 and out["setup"]["requests"] > 40
    assert out["setup"]["max_num_batched_tokens"] == 4096  # else long prompts are rejected
    assert all(out[x]["rejected"] == 0 for x in ("orca_max", "orca_pow2", "orca_oracle", "paged"))
    paged = out["paged"]["token_states_pct"]
    assert all(paged > out[x]["token_states_pct"] for x in ("orca_max", "orca_oracle"))
    assert out["batched_ratio_paged_over"]["orca_max"] >= 1
    assert (tmp_path / "memory_waste_images.png").exists()
    with pytest.raises(ConfigError, match="memory_waste_images.rate"):
        ImageWasteSettings(rate=0.0)


def test_image_waste_config_refusals():
    from experiments.config import ExperimentConfig, ImageWasteSettings
    from pagedjax.config import ConfigError

    with pytest.raises(ConfigError, match="memory_waste_images.rate"):
        ImageWasteSettings(rate=-1.0)
    with pytest.raises(ConfigError, match="throughput_vs_rate.search"):
        ExperimentConfig(
            experiments=["memory_waste_images"],
            memory_waste_images=ImageWasteSettings(rate="knee"),
        )
    ExperimentConfig(experiments=["memory_waste_images"])  # token_matched, numeric text rate
