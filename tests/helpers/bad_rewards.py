"""Reward functions with bugs, for the tests that run them inside real rollout processes."""


def raises_on_seven(prompt, response, label, metadata):
    """A per-sample reward with a bug: it divides by zero for prompts whose answer is 7."""
    return 1.0 / (label.strip() != "7")


def numeric_text(prompt, response, label, metadata):
    """Returns the score as text, which float() would accept."""
    return "1.0"


def hangs_on_seven(prompt, response, label, metadata):
    """A per-sample reward that never returns for prompts whose answer is 7 (a judge that hangs)."""
    if label.strip() == "7":
        import threading

        threading.Event().wait()
    return 1.0
