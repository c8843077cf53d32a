"""Vision encoders and multi-modal glue (issue 37): CLIP ViT tower, LLaVA projector and
placeholder merge, image preprocessing. Not yet wired into the engine (docs/multimodal.md)."""
