"""The load's output lengths read from the records without the finished requests' length bias."""

from __future__ import annotations

import numpy as np

from gputrace.whatif.lengths import fit_output_lengths, output_observations, recorded_lengths

RATE_TOK_S = 20.0  # every request decodes at this rate from its first token


def _records(n: int, end_s: float, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``n`` requests started over 60 s, outputs uniform in [512, 1024], the recording cut at ``end_s``."""
    rng = np.random.default_rng(seed)
    out = np.round(rng.uniform(512, 1024, n))
    start = np.sort(rng.uniform(0, 60, n))
    first = start + 0.1
    end = first + (out - 1) / RATE_TOK_S
    done = end <= end_s
    return {
        "start_ns": start * 1e9, "first_token_ns": first * 1e9,
        "end_ns": np.where(done, end * 1e9, np.nan), "prompt_tokens": np.full(n, 256.0),
        "completion_tokens": np.where(done, out, np.nan), "ok": done,
        "phase": np.full(n, "C=8", dtype=object), "abandoned": np.zeros(n, bool),
    }, out


def test_requests_still_running_count_as_at_least_what_they_generated() -> None:
    """A request cut by the recording's end counts its tokens so far (its phase's decode rate x
    the time since its first token) as a lower bound; a finished one its whole output."""
    rq, out = _records(200, end_s=70.0)
    tokens, finished = output_observations(rq, 70e9)
    assert np.array_equal(finished, rq["ok"])
    assert np.allclose(tokens[finished], out[finished])
    running = ~finished
    assert running.sum() > 50
    assert np.all(tokens[running] <= out[running] + 1e-6)
    assert np.allclose(tokens[running], 1 + RATE_TOK_S * (70.0 - rq["first_token_ns"][running] / 1e9))


def test_the_fitted_mean_is_the_drawn_one_not_the_finished_ones() -> None:
    """Outputs uniform in [512, 1024] (mean 768) with the long ones still running at the cut:
    the finished average 35 tokens short, the survival-aware fit within 2 %."""
    rq, out = _records(400, end_s=70.0)
    tokens, finished = output_observations(rq, 70e9)
    fitted = fit_output_lengths(tokens, finished)
    assert fitted is not None
    fitted_mean = (1 - fitted.jitter / 2) * fitted.max_tokens
    assert out[finished].mean() < 0.96 * out.mean()  # the bias the fit must undo
    assert abs(fitted_mean / out.mean() - 1) < 0.02, (fitted, out.mean())


def test_a_replay_completes_each_running_request_above_what_it_generated() -> None:
    """The recorded lengths in start order: the finished as they were, the running drawn above
    their tokens so far and no longer than the longest output, the same at every call."""
    rq, out = _records(200, end_s=70.0)
    tokens, finished = output_observations(rq, 70e9)
    fitted = fit_output_lengths(tokens, finished)
    lengths = np.array(recorded_lengths(rq, tokens, finished, fitted))
    assert lengths.shape == (200, 2)
    assert np.array_equal(lengths[finished, 1], out[finished].astype(int))
    running = ~finished
    assert np.all(lengths[running, 1] >= np.floor(tokens[running]))
    assert fitted is not None and np.all(lengths[:, 1] <= fitted.max_tokens)
    assert lengths.tolist() == [list(p) for p in recorded_lengths(rq, tokens, finished, fitted)]


def test_a_failed_request_or_one_with_no_first_token_tells_no_length() -> None:
    rq, _ = _records(50, end_s=70.0)
    for key in ("first_token_ns", "end_ns", "completion_tokens"):  # queued when the recording ended
        rq[key][:3] = np.nan
    rq["ok"][:3] = False
    rq["ok"][3] = False
    rq["end_ns"][3] = rq["start_ns"][3] + 1e8  # an HTTP error
    tokens, finished = output_observations(rq, 70e9)
    assert np.isnan(tokens[:4]).all() and not finished[:4].any()


def test_no_finished_request_fits_nothing() -> None:
    rq, _ = _records(20, end_s=5.0)
    tokens, finished = output_observations(rq, 5e9)
    assert not finished.any()
    assert fit_output_lengths(tokens, finished) is None
