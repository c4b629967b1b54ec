"""A shaped reward for the random-weights model (``make_model.py``), as a verl custom reward function.

verl's GSM8K rule scores 1.0 for a correct ``#### <answer>`` and 0 otherwise. A random byte-level model never writes
that, so every advantage would be zero and GRPO would never move the weights (the weight sync to the rollout would
then carry nothing new). This adds partial credit for digits: 0.2 x the share of digit characters in the response.
Random responses differ in it, so advantages are nonzero from step 1 and every step's update changes the policy.

``reward.custom_reward_function.path=examples/verl_grpo/reward.py`` (name ``compute_score``, verl's default).

``compute_score_half_digits`` (``reward.custom_reward_function.name=compute_score_half_digits``) peaks at half digits
instead: 0.2 x (1 - |2 x share - 1|). The share-of-digits credit is highest for an all-digit response, which a
policy reaches within a few steps: on an H100, the 1.7B shape at lr 3e-6 (scripts/checks/resume_gpu.sh) writes only
digits from step 11 on, every response earns 0.2, every advantage is 0 and the gradient norm stays 0 to step 20.
Responses keep differing in their share of digits around a middle optimum, so the runs that must learn for many
steps (the resume check) keep a gradient.
"""

from __future__ import annotations

from verl.utils.reward_score import gsm8k

DIGIT_CREDIT = 0.2


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return _shaped(solution_str, ground_truth, lambda digits, n: DIGIT_CREDIT * digits / n)


def compute_score_half_digits(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return _shaped(solution_str, ground_truth, lambda digits, n: DIGIT_CREDIT * (1.0 - abs(2.0 * digits / n - 1.0)))


def _shaped(solution_str, ground_truth, credit) -> float:
    """verl's GSM8K score where the answer is right, else ``credit(digit characters, characters)``."""
    exact = gsm8k.compute_score(solution_str, ground_truth)
    if exact > 0:
        return float(exact)
    if not solution_str:
        return 0.0
    return credit(sum(c.isdigit() for c in solution_str), len(solution_str))
