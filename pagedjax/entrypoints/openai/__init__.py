"""vLLM's OpenAI-compatible server over AsyncLLMEngine (docs/serving.md)."""
