"""The Content-Security-Policy breaks nothing a browser shows: the API docs (Swagger UI) and the admin's dashboard.

Chromium reports every resource or script the policy blocks on the page's console; none may appear.
"""

import asyncio
import re

import pytest
from playwright.async_api import async_playwright, expect

from tests.browser.conftest import launch, log_in

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT_MS = 30_000


def test_the_api_docs_and_the_dashboard_work_under_the_csp(chromium, live_server_url, operator, project):
    base = live_server_url

    async def scenario():
        async with async_playwright() as playwright:
            browser = await launch(playwright, chromium)
            try:
                context = await browser.new_context()
                context.set_default_timeout(TIMEOUT_MS)
                page = await context.new_page()
                console = []
                page.on("console", lambda message: console.append(message.text))

                response = await page.goto(f"{base}/v1/docs")
                assert "script-src 'self'" in response.headers["content-security-policy"]
                # Swagger UI drew the API from the schema: its title and an operation of /v1/runs.
                await expect(page.locator(".swagger-ui .info .title")).to_contain_text("runstate API")
                await expect(page.locator(".opblock-summary-path", has_text="/v1/runs").first).to_be_visible()

                await log_in(page, base, operator)
                await page.goto(f"{base}/admin/dashboard/")
                await expect(page.locator("#rs-live")).to_have_attribute("data-state", "live")
                # The project selector reloads the page for the project (its handler was inline once).
                await page.select_option('select[name="project"]', project.name)
                await page.wait_for_url(re.compile(rf"project={project.name}"))
                await expect(page.locator("#rs-live")).to_have_attribute("data-state", "live")
                await page.goto(f"{base}/admin/coordination/run/")
                await expect(page.locator("#changelist")).to_be_visible()
                assert [text for text in console if "Content Security Policy" in text] == []
            finally:
                await browser.close()

    asyncio.run(scenario())
