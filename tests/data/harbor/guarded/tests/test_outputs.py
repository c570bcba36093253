from pathlib import Path


def test_answer_is_the_sum():
    assert Path("/app/answer.txt").read_text().strip() == "42"
