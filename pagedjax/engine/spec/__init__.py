"""Speculative decoding: one module per proposer (``ngram``, ``layer_skip``,
``draft_model``, ``eagle``, ``medusa``), the verification program (``verify``), the draft
pools that follow swap (``draft_pool``) and the decoder that plans, verifies and commits
(``decoder``). docs/speculative_decoding.md gives the reasons."""
