"""Interactive chat in the terminal, streaming tokens as they are generated."""

from __future__ import annotations

import itertools
import sys

from dsinfer.engine.sampling_params import RequestOutputKind, SamplingParams


def run_repl(llm, params: SamplingParams) -> int:
    """Read a line, answer it with the whole conversation as context; /exit or EOF quits, /reset clears."""
    from dataclasses import replace

    from dsinfer.protocol.chat_encoding import ChatEncoder
    from dsinfer.protocol.errors import ProtocolError

    engine, tokenizer = llm.engine, llm.engine.tokenizer  # dsinfer's Tokenizer, which ChatEncoder takes
    if tokenizer is None or tokenizer.chat_template is None:
        print("error: this model has no chat template; use `dsinfer generate` with raw text", file=sys.stderr)
        return 2
    # typed text is tokenized literally: a special-token string stays text, as in LLM.chat and the server
    encoder = ChatEncoder(tokenizer, tokenizer.chat_template)
    params = replace(params, output_kind=RequestOutputKind.DELTA)
    history: list[dict[str, str]] = []
    ids = itertools.count()
    print("dsinfer chat: /reset clears the conversation, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            encoded = encoder.encode(history, add_generation_prompt=True)
            prompt = {"prompt": encoded.text, "prompt_token_ids": encoded.token_ids}
            engine.add_request(f"repl-{next(ids)}", prompt, params)
        except (ValueError, ProtocolError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            history.pop()
            continue
        answer = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                piece = output.outputs[0].text
                answer.append(piece)
                print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
