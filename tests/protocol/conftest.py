from __future__ import annotations

import pytest
from tiny_tokenizer import write_tiny_tokenizer

from dsinfer.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok")))
