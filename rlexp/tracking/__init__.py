"""Experiment trackers behind one small interface; metrics.jsonl in the run dir is always written."""

from rlexp.tracking.base import JsonlTracker, Tracker, Trackers, build_trackers, discard_records

__all__ = ["JsonlTracker", "Tracker", "Trackers", "build_trackers", "discard_records"]
