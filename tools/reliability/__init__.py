"""Reliability runs: soak, faults under load, request-body fuzzing, hostile inputs, auth timing."""
