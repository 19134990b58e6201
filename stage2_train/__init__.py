"""Stage 2: train a student from the teacher-loss cache (no teacher in memory)."""
