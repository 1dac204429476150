/**
 * Learning how an in-doubt step was settled: repeat it until its answer is no
 * longer `in_doubt` (Result v1 `in_doubt.learn` = `repeat_step`).
 */
import type { Answer } from "./answer.js";
import { freshCallId, type CallOptions, type Transport } from "./transport.js";

/** How `waitSettled` repeats a step. */
export interface WaitSettledOptions extends Omit<CallOptions, "onHeld"> {
  /** At most this long in all (default 300 s): then the last, in-doubt, answer. */
  withinMs?: number;
  /** Between two repeats (default 2 s). */
  everyMs?: number;
  /**
   * Also wait on a step a person settles (`inDoubt.settling === "person"`).
   * Default false: nobody knows when a person decides, so such a step is
   * returned at once.
   */
  waitForPerson?: boolean;
}

/** In doubt, and someone is expected to settle it while we wait. */
function keepsWaiting(answer: Answer, waitForPerson: boolean): boolean {
  return answer.status === "in_doubt" && (waitForPerson || answer.reconciling);
}

function pause(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal!.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * The settled answer of an in-doubt step: the step repeated — same workflow,
 * step index, tool and attempt, each repeat a call of its own (`callId`) —
 * every `everyMs`, until its answer is no longer `in_doubt`. At most
 * `withinMs`: then the last (in-doubt) answer.
 *
 * A repeat returns the same in-doubt answer until the step is settled, then
 * the settled one: the tool's result if the call took effect, or, if it did
 * not, the result of running it once then (with the same key). An answer not
 * in doubt is returned at once; so is one a person settles, unless
 * `waitForPerson`. A repeat that is not answered in time is made again at the
 * next turn. `signal` stops the wait (the promise rejects with its reason).
 */
export async function waitSettled(
  transport: Transport,
  answer: Answer,
  args: Record<string, unknown>,
  options: WaitSettledOptions = {},
): Promise<Answer> {
  const { withinMs = 300_000, everyMs = 2_000, waitForPerson = false, signal, timeoutMs } = options;
  const deadline = Date.now() + withinMs;
  let last = answer;
  while (keepsWaiting(last, waitForPerson) && Date.now() < deadline) {
    await pause(Math.max(0, Math.min(everyMs, deadline - Date.now())), signal);
    const left = deadline - Date.now();
    const outcome = await transport.call(
      {
        workflowId: last.workflowId,
        stepIndex: last.stepIndex,
        tool: last.tool,
        arguments: args,
        attempt: last.attempt,
        callId: freshCallId(),
      },
      { timeoutMs: Math.max(1, Math.min(timeoutMs ?? left, left)), ...(signal ? { signal } : {}) },
    );
    // A step found in doubt was never held for a person: anything but an
    // answer is a repeat not answered in time.
    if (outcome.kind === "answer") last = outcome;
  }
  return last;
}
