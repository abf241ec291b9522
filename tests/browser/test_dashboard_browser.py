"""An operator in Chromium: log in, watch the dashboard, cancel a subtree, see the counts move live.

Screenshots go to test-artifacts/screenshots/<database>/ (git-ignored).
"""

import asyncio
import re

import pytest
from playwright.async_api import async_playwright, expect

from coordination.domain.states import RunState, Verdict
from coordination.models import Run
from coordination.services.claims import claim_complete, task_claim
from coordination.services.groups import group_create, group_submit, group_verdict
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from tests.browser.conftest import launch, log_in

# The server process reads and writes the same database: everything here must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT_MS = 30_000


def count(page, key: str):
    return page.locator(f'[data-count="{key}"]')


@pytest.fixture
def swarm(project):
    """A root run, two workers below it with queued tasks, one task running."""
    jobs, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    root = run_create(project_id=project.id, name="swarm")
    workers = [run_create(project_id=project.id, parent_id=root.id, name=f"worker-{n}") for n in (1, 2)]
    for worker in workers:
        for n in range(4):
            task_submit(project_id=project.id, mailbox=jobs, run_id=worker.id, input={"n": n})
    task_claim(project_id=project.id, mailbox=jobs, run_id=workers[0].id, worker_id="w-1")
    return root, workers


def test_an_operator_cancels_a_subtree_and_watches_the_counts_change_live(
    chromium, live_server_url, operator, swarm, screenshots
):
    root, workers = swarm
    base = live_server_url

    async def scenario():
        async with async_playwright() as playwright:
            browser = await launch(playwright, chromium)
            try:
                context = await browser.new_context(viewport={"width": 1400, "height": 1100})
                context.set_default_timeout(TIMEOUT_MS)
                dashboard = await context.new_page()
                await log_in(dashboard, base, operator)

                await dashboard.goto(f"{base}/admin/dashboard/")
                await expect(dashboard.locator("#rs-live")).to_have_attribute("data-state", "live")
                await expect(count(dashboard, "tasks.QUEUED")).to_have_text("7")
                await expect(count(dashboard, "tasks.RUNNING")).to_have_text("1")
                await expect(count(dashboard, "tasks.CANCELLED")).to_have_text("0")
                await dashboard.screenshot(path=screenshots / "01-dashboard.png", full_page=True)

                # The run tree: open the root, its workers appear with their effective state.
                await dashboard.click(f'details[data-run-id="{root.id}"] > summary')
                worker_node = dashboard.locator(f'li[data-run="{workers[0].id}"]')
                await expect(worker_node).to_be_visible()
                await expect(worker_node.locator('[data-field="effective"]')).to_have_text("effective ACTIVE")
                await dashboard.locator('[data-panel="tree"]').screenshot(path=screenshots / "02-run-tree.png")

                # Marks this page: a reload would lose it, so finding it later proves there was none.
                await dashboard.evaluate("window.__notReloaded = true")

                # In a second tab, cancel the subtree through the confirmation page.
                link = dashboard.locator(f'li[data-run="{root.id}"] a.rs-action', has_text="cancel subtree")
                href = await link.first.get_attribute("href")
                confirm = await context.new_page()
                await confirm.goto(f"{base}{href}")
                row = confirm.locator(f'#rs-subtree-work tr[data-run="{root.id}"]')
                await expect(row.locator('[data-work="queued_tasks"]')).to_have_text("7")
                await expect(row.locator('[data-work="running_tasks"]')).to_have_text("1")
                await expect(row.locator('[data-work="runs"]')).to_have_text("3 (3)")
                await confirm.fill("#id_reason", "stopped from the browser test")
                await confirm.screenshot(path=screenshots / "03-confirmation.png", full_page=True)
                await confirm.click("#rs-confirm")
                await confirm.wait_for_url(f"{base}/admin/dashboard/")
                await expect(confirm.locator(".messagelist")).to_contain_text("Cancelled 1 run")

                # Back on the first tab, untouched: the counts move on their own.
                await expect(count(dashboard, "tasks.CANCELLED")).to_have_text("8")
                await expect(count(dashboard, "tasks.QUEUED")).to_have_text("0")
                await expect(count(dashboard, "tasks.RUNNING")).to_have_text("0")
                await expect(count(dashboard, "runs.CANCELLED")).to_have_text("1")
                await expect(worker_node.locator('[data-field="effective"]')).to_contain_text("INACTIVE: CANCELLED")
                assert await dashboard.evaluate("window.__notReloaded === true")
                events = dashboard.locator("#rs-events")
                await expect(events).to_contain_text("run.cancelled")
                await dashboard.screenshot(path=screenshots / "04-after-cancel.png", full_page=True)
            finally:
                await browser.close()

    asyncio.run(scenario())
    root.refresh_from_db()
    assert (root.stored_state, root.cancel_reason) == (RunState.CANCELLED, "stopped from the browser test")
    assert Run.objects.get(id=workers[1].id).stored_state == RunState.ACTIVE  # the child's own state stays


def test_an_operator_reads_a_groups_verdicts(chromium, live_server_url, operator, project, screenshots):
    jobs, _ = mailbox_ensure(project_id=project.id, name="review", mode="WORK")
    group = group_create(project_id=project.id, mailbox_name="review", condition="N_ACCEPTED", threshold=2, name="vote")
    members = [group_submit(project_id=project.id, group_id=group.id, input={"n": n}, key=f"m{n}")[0] for n in range(3)]
    for _ in members:
        (claim,) = task_claim(project_id=project.id, mailbox=jobs, run_id=group.scope_id, worker_id="reviewer")
        claim_complete(project_id=project.id, claim_id=claim.claim_id, outcome={"ok": True})
    group_verdict(project_id=project.id, group_id=group.id, task_id=members[0].id, verdict=Verdict.ACCEPTED)
    group_verdict(project_id=project.id, group_id=group.id, task_id=members[1].id, verdict=Verdict.REJECTED)

    async def scenario():
        async with async_playwright() as playwright:
            browser = await launch(playwright, chromium)
            try:
                page = await browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(TIMEOUT_MS)
                await log_in(page, live_server_url, operator)
                await page.goto(f"{live_server_url}/admin/dashboard/")
                pending = page.locator(f'tr[data-group="{group.id}"]')
                await expect(pending).to_contain_text("1/2")  # accepted/threshold
                await pending.locator("a").first.click()
                await page.wait_for_url(re.compile(rf".*/taskgroup/{group.id}/change/"))
                table = page.locator("table.group-members")
                for member, verdict in zip(members, ("ACCEPTED", "REJECTED", "-"), strict=True):
                    row = table.locator("tr", has_text=str(member.id))
                    await expect(row).to_contain_text("SUCCEEDED")
                    if verdict != "-":
                        await expect(row).to_contain_text(verdict)
                await page.screenshot(path=screenshots / "05-group-verdicts.png", full_page=True)
            finally:
                await browser.close()

    asyncio.run(scenario())
