"""The Python snippets of the reference document (seeds/000_b3519fa2e86ad14e.txt), verbatim.

Copied character for character, in the order of the document; ``test_seed.py`` runs each
with ``rs = AsyncRunstate()`` in its namespace (the only change the contract allows, plus a
one-second timer delay where the document waits 300 s).
"""

# Create a group and submit members
GROUP_CREATE_AND_SUBMIT = """\
await rs.mailboxes.ensure("reviews", mode="WORK")
run = await rs.scopes.create()

# Done when five drafts have been accepted.
group = await run.groups.create(
    mailbox="reviews",
    condition="N_ACCEPTED",
    threshold=5,
    parent_scope_id=run.id,  # cancelling the run also closes the group
)

tickets = []
for i in range(12):
    tickets.append(await group.submit({"draft": i}, key=f"draft-{i}"))
# No more members: from now on the group can also fail as unreachable.
await group.close()

# Workers must attach to the group's own run to receive its members.
group_run_id = (await group.status())["scopeId"]
print(f"start workers with RUNSTATE_SCOPE_ID={group_run_id}")
"""

# Record verdicts and wait for the decision
GROUP_VERDICTS_AND_WAIT = """\
# A reviewer process: judge each finished member.
for ticket in tickets:
    result = await ticket.result(timeout_ms=600_000)
    if result["state"] != "SUCCEEDED":
        continue
    if is_good_draft(result["outcome"]):
        verdict = await group.accept(ticket.id)
    else:
        verdict = await group.reject(ticket.id)
    if verdict["groupState"] == "FINALIZED":
        break

decision = await group.wait(timeout_ms=600_000)
print(decision["outcome"], decision["outcomeReason"])  # e.g. SUCCESS threshold_reached
"""

# Cancel a run
RUN_CANCEL = """\
from datetime import datetime, timedelta, timezone

deadline = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
run = await rs.scopes.create(deadline=deadline)  # optional: stop accepting work after an hour
shard = await run.child()  # a sub-run, cancelled along with its parent

# ... later, from any process that knows the run id:
await rs.scope(run.id).cancel()

status = await shard.status()
print(status["storedState"], status["effective"])  # ACTIVE INACTIVE
"""

# Barriers
BARRIERS = """\
# Coordinator:
barrier = await run.barriers.create(target=3)

# Each shard, given barrier.id:
handle = rs.scope(run.id).barriers.get(barrier.id)
await handle.arrive(key="shard-2")  # idempotent per key
view = await handle.wait(timeout_ms=300_000)
print(view["state"], f"{view['arrivals']}/{view['target']}")
"""

# Timers
TIMERS = """\
timer = await run.timers.create(after_seconds=300)
print(f"fires at {timer.fire_at.isoformat()}")

fired = await timer.wait(timeout_ms=360_000)
print(f"follow-up check at {fired['fired_at'].isoformat()}")
"""
