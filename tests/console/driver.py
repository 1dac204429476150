"""Drives the stepgate console in a real headless Chromium (Debian's, through
Playwright) for tests/broker/console.rs, one command per line on standard input, one
JSON answer per line on standard output. The test (Rust) runs the broker, the
gate, the agent and the console, and says what a person does when.

Commands:
  login TOKEN                 sign in through the login form
  goto PATH                   open a page
  wait_card TEXT MS           wait until a card naming TEXT shows (without a
                              reload); answers the milliseconds it took, and
                              for a held call those since the gate held it
  click_in_card TEXT BUTTON   click the button labelled BUTTON in that card,
                              wait for the page it leads to; answers its notice
  deny TEXT REASON...         type the reason in that card's Deny form, click Deny
  fail TEXT FOUND...          type what was found in that card's "failed" form,
                              click "Mark as failed"
  count SELECTOR              how many elements match
  visible TEXT...             whether an element with that exact text shows
  click_text TEXT...          click the first element showing that text (a
                              <summary> that opens its <details>)
  fresh                       a new browser context (signed out)
  problems                    console errors and CSP refusals seen so far
  text                        the page's visible text
  html                        the page's HTML
  screenshot PATH             a full-page PNG
  quit
"""

import json
import os
import sys
import time

from playwright.sync_api import sync_playwright


def answer(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def card(page, text):
    return page.locator("article.card").filter(has_text=text).first


def main():
    base = sys.argv[1].rstrip("/")
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        # Any script refused by the Content-Security-Policy, or failing, is reported.
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        answer(ready=True)
        for line in sys.stdin:
            parts = line.rstrip("\n").split(" ")
            cmd, args = parts[0], parts[1:]
            try:
                if cmd == "login":
                    page.goto(base + "/login")
                    page.fill("#token", args[0])
                    with page.expect_navigation():
                        page.click("section.login button[type=submit]")
                    answer(url=page.url)
                elif cmd == "fresh":
                    context.close()
                    context = browser.new_context(viewport={"width": 1280, "height": 900})
                    page = context.new_page()
                    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
                    page.on("pageerror", lambda e: problems.append(str(e)))
                    answer(fresh=True)
                elif cmd == "goto":
                    r = page.goto(base + args[0])
                    answer(status=r.status if r else None, url=page.url)
                elif cmd == "wait_card":
                    t0 = time.monotonic()
                    c = card(page, args[0])
                    c.wait_for(state="visible", timeout=int(args[1]))
                    ms = int((time.monotonic() - t0) * 1000)
                    # From when the gate held it (a held call's card says when).
                    held = c.evaluate(
                        "e => e.dataset.heldAtMs ? Date.now() - Number(e.dataset.heldAtMs) : null"
                    )
                    answer(ms=ms, since_held_ms=held)
                elif cmd == "click_in_card":
                    label = " ".join(args[1:])
                    with page.expect_navigation():
                        card(page, args[0]).get_by_role("button", name=label).click()
                    notice = page.locator(".notice")
                    answer(notice=notice.first.inner_text() if notice.count() else "", url=page.url)
                elif cmd == "deny":
                    c = card(page, args[0])
                    c.locator("input[name=reason]").fill(" ".join(args[1:]))
                    with page.expect_navigation():
                        c.get_by_role("button", name="Deny").click()
                    notice = page.locator(".notice")
                    answer(notice=notice.first.inner_text() if notice.count() else "", url=page.url)
                elif cmd == "fail":
                    c = card(page, args[0])
                    form = c.locator("form:has(input[name=outcome][value=failed])")
                    form.locator("input[name=reason]").fill(" ".join(args[1:]))
                    with page.expect_navigation():
                        form.get_by_role("button", name="Mark as failed").click()
                    notice = page.locator(".notice")
                    answer(notice=notice.first.inner_text() if notice.count() else "", url=page.url)
                elif cmd == "visible":
                    answer(visible=page.get_by_text(" ".join(args)).first.is_visible())
                elif cmd == "click_text":
                    page.get_by_text(" ".join(args)).first.click()
                    answer(clicked=True)
                elif cmd == "count":
                    answer(n=page.locator(" ".join(args)).count())
                elif cmd == "text":
                    answer(text=page.inner_text("body"))
                elif cmd == "html":
                    answer(html=page.content())
                elif cmd == "screenshot":
                    page.screenshot(path=args[0], full_page=True)
                    answer(saved=args[0])
                elif cmd == "problems":
                    answer(problems=problems)
                elif cmd == "quit":
                    answer(bye=True)
                    break
                else:
                    answer(error="unknown command " + cmd)
            except Exception as e:  # the test reads the failure and says it
                answer(error=f"{type(e).__name__}: {e}")
        browser.close()


if __name__ == "__main__":
    main()
