"""Evaluation of any student or teacher: held-out bits per character and math answer accuracy."""
