"""Pinned evaluation sets: checksum, rule, and the training stream that avoids them."""

import json

import pytest

from rlexp.envs import pinned
from rlexp.envs.maze import expert_actions, generate_maze
from rlexp.envs.pinned import (
    PINNED_COUNT,
    PINNED_SETS,
    PinnedSetChanged,
    TrainingMazeStream,
    build_pinned,
    content_sha256,
    load_pinned,
    load_pinned_file,
    pinned_layout_hashes,
    pinned_path,
)

NAMES = list(PINNED_SETS)


@pytest.mark.parametrize("name", NAMES)
def test_file_checksum_matches_constant(name):
    data = json.loads(pinned_path(name).read_text())
    assert content_sha256(data) == pinned.PINNED_SHA256[name]


@pytest.mark.parametrize("name", NAMES)
def test_file_follows_the_rule(name):
    """The file is exactly what the rule gives with today's generator."""
    data = load_pinned_file(name)
    assert data == build_pinned(name)
    spec = PINNED_SETS[name]
    assert (data["size"], data["max_steps"], data["count"]) == (spec["size"], spec["max_steps"], PINNED_COUNT)
    assert "skipping any maze whose expert solution" in data["rule"]


@pytest.mark.parametrize("name", NAMES)
def test_pinned_mazes_fit_and_seeds_are_the_first_that_fit(name):
    data = load_pinned_file(name)
    size, max_steps = data["size"], data["max_steps"]
    mazes = load_pinned(name)
    seeds = [m.seed for m in mazes]
    assert len(mazes) == PINNED_COUNT and seeds == sorted(seeds) and len(set(seeds)) == PINNED_COUNT
    assert sorted(seeds + data["skipped_seeds"]) == list(range(seeds[-1] + 1))
    for maze, record in zip(mazes, data["mazes"]):
        assert maze.size == size and maze == generate_maze(size, maze.seed)
        assert record["expert_length"] == len(expert_actions(maze)) <= max_steps
        assert record["layout_hash"] == maze.layout_hash()
    for seed in data["skipped_seeds"]:
        assert len(expert_actions(generate_maze(size, seed))) > max_steps
    assert len(pinned_layout_hashes(name)) == PINNED_COUNT


def test_easy_set_skips_some_seeds():
    """With 4x4 rooms some corner-to-corner paths need 20+ moves: the skip rule is exercised."""
    assert load_pinned_file("maze_easy")["skipped_seeds"]


def test_changed_file_is_refused(monkeypatch):
    monkeypatch.setitem(pinned.PINNED_SHA256, "maze_easy", "0" * 64)
    pinned._load_verified.cache_clear()
    try:
        with pytest.raises(PinnedSetChanged, match="has changed"):
            load_pinned("maze_easy")
    finally:
        monkeypatch.undo()
        pinned._load_verified.cache_clear()
    assert len(load_pinned("maze_easy")) == PINNED_COUNT


def test_unknown_set_names_the_choices():
    with pytest.raises(ValueError, match="maze_easy.*maze_hard"):
        load_pinned("maze_medium")


@pytest.mark.parametrize("name", NAMES)
def test_training_stream_never_yields_pinned_mazes(name):
    spec = PINNED_SETS[name]
    stream = TrainingMazeStream(spec["size"], spec["max_steps"], seed=0)
    batch = stream.next_batch(300)
    pinned_seeds = {m.seed for m in load_pinned(name)}
    assert not {m.seed for m in batch} & pinned_seeds
    assert not {m.layout_hash() for m in batch} & pinned_layout_hashes(name)
    assert all(len(expert_actions(m)) <= spec["max_steps"] for m in batch)


def test_training_stream_excludes_by_layout_hash():
    first = TrainingMazeStream(9, 20, seed=3).next_batch(1)[0]
    stream = TrainingMazeStream(9, 20, seed=3, exclude_hashes={first.layout_hash()})
    assert first.layout_hash() not in {m.layout_hash() for m in stream.next_batch(5)}


def test_training_stream_is_deterministic_and_resumable():
    a = TrainingMazeStream(11, 30, seed=1)
    head = a.next_batch(4)
    state = a.state_dict()
    rest = a.next_batch(6)
    b = TrainingMazeStream(11, 30, seed=1)
    assert b.next_batch(4) == head
    c = TrainingMazeStream(11, 30, seed=1)
    c.load_state_dict(state)
    assert c.next_batch(6) == rest
    assert TrainingMazeStream(11, 30, seed=2).next_batch(4) != head
    with pytest.raises(ValueError, match="seed"):
        TrainingMazeStream(11, 30, seed=2).load_state_dict(state)


def test_training_stream_min_expert_length_keeps_the_long_mazes_in_stream_order():
    every = TrainingMazeStream(9, 20, seed=4).next_batch(60)
    expected = [m for m in every if len(expert_actions(m)) >= 17]
    assert 0 < len(expected) < len(every)  # maze_easy has 13- and 17-step experts: the filter must drop some
    assert TrainingMazeStream(9, 20, seed=4, min_expert_length=17).next_batch(len(expected)) == expected


def test_training_stream_with_no_maze_in_its_length_window_says_so():
    stream = TrainingMazeStream(9, 20, seed=0, min_expert_length=18)  # 9x9 experts take 13, 17, 21, ... steps
    with pytest.raises(ValueError, match="18..20 steps"):
        stream.next_batch(1)


def test_training_stream_state_keeps_the_length_window():
    state = TrainingMazeStream(9, 20, seed=0, min_expert_length=17).state_dict()
    with pytest.raises(ValueError, match="min_expert_length"):
        TrainingMazeStream(9, 20, seed=0).load_state_dict(state)
    before_the_key = {key: value for key, value in TrainingMazeStream(9, 20, seed=0).state_dict().items() if key != "min_expert_length"}
    TrainingMazeStream(9, 20, seed=0).load_state_dict(before_the_key)  # a checkpoint from before the option resumes


def test_cli_check_passes(capsys):
    assert pinned.main(["--check"]) == 0
    assert capsys.readouterr().out.count("matches rule True, matches PINNED_SHA256 True") == 2
