"""What a Ray job's working-dir upload leaves behind, checked with Ray's own packaging hash."""

import pytest

from rlexp.cluster.ray_jobs import EXCLUDES, upload_excludes

packaging = pytest.importorskip("ray._private.runtime_env.packaging", reason="needs Ray (pip install 'rlexp[ray]')")


def _checkout(tmp_path, exclude_text):
    (tmp_path / ".git" / "info").mkdir(parents=True)
    (tmp_path / ".git" / "info" / "exclude").write_text(exclude_text)
    (tmp_path / "train.py").write_text("print('the code the job runs')\n")
    (tmp_path / ".vllm").mkdir()
    (tmp_path / ".vllm" / "wheel.part").write_bytes(b"a local store of wheels")
    return tmp_path


def _upload_hash(directory, excludes):
    return packaging.get_uri_for_directory(str(directory), include_gitignore=True, excludes=excludes)


def test_git_info_exclude_patterns_are_left_out_of_the_upload(tmp_path):
    checkout = _checkout(tmp_path, "# git ls-files --others --exclude-from=.git/info/exclude\n\n/.vllm/\n")
    excludes = upload_excludes(checkout)
    assert excludes == EXCLUDES + ["/.vllm/"]
    before = _upload_hash(checkout, excludes)
    (checkout / ".vllm" / "wheel.part").write_bytes(b"another chunk")
    assert _upload_hash(checkout, excludes) == before  # the excluded store does not travel
    assert _upload_hash(checkout, EXCLUDES) != before  # without the file's patterns, Ray would upload it
    (checkout / "train.py").write_text("print('changed code')\n")
    assert _upload_hash(checkout, excludes) != before  # the code itself still travels


def test_a_working_dir_without_git_gets_the_fixed_excludes(tmp_path):
    assert upload_excludes(tmp_path) == EXCLUDES
