"""Vision encoders and multi-modal glue (issue 37; docs/multimodal.md): the ViT encoder
CLIP and SigLIP share (vit.py), the CLIP tower and LLaVA's projector and merge (clip.py,
llava.py), the SigLIP tower and Idefics3 / SmolVLM's connector, prompt text and
preprocessing (siglip.py, idefics3.py), image decoding (preprocess.py). The engine's
side is engine/vision_models.py (loading, by family) and engine/multimodal.py (requests)."""
