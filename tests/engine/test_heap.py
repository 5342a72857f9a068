"""The step loops' frozen start-up heap: frozen while a loop runs, given back after (an exception included); a
small earlier freeze neither keeps the rest of the heap in the walks nor is undone."""

import gc

import pytest

from dsinfer.engine.heap import startup_heap_frozen


@pytest.fixture(autouse=True)
def _no_freeze_around():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_alive_at_the_start_are_frozen_while_the_loop_runs():
    alive = [object() for _ in range(10)]
    assert gc.get_freeze_count() == 0
    with startup_heap_frozen():
        assert gc.get_freeze_count() >= len(alive)
        made_inside = [[] for _ in range(10)]
        assert any(x is made_inside for x in gc.get_objects())  # the loop's own objects stay collectable
    assert gc.get_freeze_count() == 0


def test_the_heap_is_given_back_when_the_loop_raises():
    with pytest.raises(RuntimeError), startup_heap_frozen():
        raise RuntimeError("a failing step")
    assert gc.get_freeze_count() == 0


def test_an_earlier_small_freeze_still_freezes_the_rest_and_stays():
    early = [[] for _ in range(5)]
    gc.freeze()  # someone froze a few objects at start-up
    later = [[] for _ in range(1000)]  # the model and its caches, made after
    frozen_early = gc.get_freeze_count()
    with startup_heap_frozen():
        assert gc.get_freeze_count() >= frozen_early + len(later)
        assert not any(x is later[0] for x in gc.get_objects())
    # the earlier freeze is not undone (the count may drop: frozen objects are freed when their last reference goes)
    assert gc.get_freeze_count() > 0 and early


def test_generate_runs_its_steps_with_the_heap_frozen(tiny_llama_dir, monkeypatch):
    from dsinfer import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32")
    counts = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: counts.append(gc.get_freeze_count()) or step())
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert counts and all(c > 0 for c in counts)
    assert gc.get_freeze_count() == 0
