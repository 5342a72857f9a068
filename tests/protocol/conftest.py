from __future__ import annotations

import pytest

from dsinfer.tokenizer import Tokenizer

from .tiny_tokenizer import write_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok")))
