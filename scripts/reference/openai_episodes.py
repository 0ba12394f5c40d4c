"""Drives a served job's OpenAI-compatible endpoint (`[rl.serve]`) with the
`openai` Python client, as an agent harness would: two-turn tool episodes
(the policy's reply, a tool's result, the policy's answer), each group's
episodes sharing a prompt, a reward per episode. Checks what a harness
relies on and prints one JSON line of what it saw.

    openai_episodes.py OUTPUT_DIR/endpoint.json

Runs until the job stops taking calls (it completed its steps).
"""
import json
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _deps import ensure_openai  # noqa: E402

ensure_openai()
import openai  # noqa: E402

CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def fail(msg):
    print(f"harness check failed: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    ep = json.load(open(sys.argv[1]))
    client = openai.OpenAI(base_url=ep["base_url"], api_key=ep["api_key"] or "none", max_retries=0,
                           timeout=120)
    seen = {"episodes": 0, "calls": 0, "reports": 0, "refused_edit": False, "refused_token": False,
            "repeat_same": False, "tool_message_tokens": None}
    # A wrong key is refused before anything runs.
    bad = openai.OpenAI(base_url=ep["base_url"], api_key="not-the-key", max_retries=0)
    try:
        bad.models.list()
        fail("a wrong key was accepted")
    except openai.AuthenticationError:
        seen["refused_token"] = True
    models = client.models.list()
    if [m.id for m in models.data] != [ep["job"]]:
        fail(f"models: {models}")

    def call(episode, messages):
        r = client.chat.completions.create(
            model=ep["job"], messages=messages, tools=CALCULATOR, logprobs=True, temperature=1.0,
            max_tokens=8, extra_headers={"x-accrue-episode": episode},
            extra_body={"return_token_ids": True})
        seen["calls"] += 1
        c = r.choices[0]
        ids = c.model_extra["token_ids"]
        lps = [t.logprob for t in c.logprobs.content]
        if len(ids) != r.usage.completion_tokens or len(lps) != len(ids):
            fail(f"{episode}: {len(ids)} ids, {len(lps)} log-probs, usage {r.usage}")
        if any(lp > 0 or lp != lp for lp in lps):
            fail(f"{episode}: log-probs {lps}")
        if c.finish_reason not in ("stop", "length", "tool_calls"):
            fail(f"finish_reason {c.finish_reason}")
        if r.model_extra["accrue"]["episode"] != episode:
            fail(f"episode {r.model_extra['accrue']}")
        return r, r.model_extra["prompt_token_ids"], ids

    g = 0
    try:
        while True:
            g += 1
            for k in range(2):
                episode = f"g{g}-e{k}"
                msgs = [{"role": "system", "content": "Use the calculator."},
                        {"role": "user", "content": f"What is {g} * 37?"}]
                r1, p1, c1 = call(episode, msgs)
                # The reply as the client returns it, then the tool's result.
                msgs.append(r1.choices[0].message.model_dump(exclude_none=True))
                msgs.append({"role": "tool", "tool_call_id": "call_0", "content": str(g * 37)})
                if g == 1 and k == 0:
                    # A call that edits the episode's history is refused,
                    # naming the message, and leaves the episode as it was.
                    edited = [dict(m) for m in msgs]
                    edited[1]["content"] = "What is 1 * 1?"
                    try:
                        call(episode, edited)
                        fail("an edited history was accepted")
                    except openai.BadRequestError as e:
                        if "messages[1]" not in str(e):
                            fail(f"the refusal does not name messages[1]: {e}")
                        seen["refused_edit"] = True
                r2, p2, c2 = call(episode, msgs)
                # Token in, token out: turn 2 continues turn 1's tokens.
                if p2[: len(p1) + len(c1)] != p1 + c1:
                    fail(f"{episode}: turn 2's prompt does not extend turn 1's tokens")
                seen["tool_message_tokens"] = len(p2) - len(p1) - len(c1)
                if r2.model_extra["accrue"]["turn"] != 2:
                    fail(f"turn {r2.model_extra['accrue']}")
                seen["episodes"] += 1
                # Rewards differ within a group (its advantages are not 0).
                report = client.post(f"/episodes/{episode}/reward", cast_to=object,
                                     body={"reward": float(k)})
                seen["reports"] += 1
                if report["turns"] != 2 or report["accepted"] != 1:
                    fail(f"report {report}")
                if g == 1 and k == 0:
                    again = client.post(f"/episodes/{episode}/reward", cast_to=object,
                                        body={"reward": 5.0})
                    seen["repeat_same"] = again.get("repeated") is True and again["tokens"] == report["tokens"]
    except (openai.ConflictError, openai.NotFoundError) as e:
        # The job completed: its endpoint stops taking calls.
        seen["stopped"] = str(e)[:200]
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
