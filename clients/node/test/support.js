// Helpers for the live tests (not a test file: `npm test` runs test/*.test.js only).
import { readFileSync } from "node:fs";
import path from "node:path";
import { STATE_FILE } from "../src/rundir.js";
import { taskFromRow } from "../src/index.js";

export const RUN_DIR = process.env.GYMRPC_RUN_DIR;
export const NEEDS_STACK = RUN_DIR
  ? false
  : "needs a live stack: set GYMRPC_RUN_DIR (tests/clients/test_node.py starts one with `gymrpc up`)";

/** `stack.json`, as `gymrpc up` keeps it: launcher pid and every server's name, pid and address. */
export function readStack(runDir = RUN_DIR) {
  return JSON.parse(readFileSync(path.join(runDir, STATE_FILE), "utf8"));
}

export function server(name, runDir = RUN_DIR) {
  return readStack(runDir).servers.find((s) => s.name === name);
}

/** SIGKILL the launcher first (so nothing is restarted), then every server: a crash of the whole stack. */
export function killStack(runDir = RUN_DIR) {
  const stack = readStack(runDir);
  for (const pid of [stack.launcher_pid, ...stack.servers.map((s) => s.pid)]) {
    if (!pid) continue;
    try {
      process.kill(pid, "SIGKILL");
    } catch (err) {
      if (err.code !== "ESRCH") throw err;
    }
  }
}

/** Row `line` of the counter environment's example tasks. */
export function counterTask(line = 0) {
  const file = new URL("../../../envs/counter/data/example.jsonl", import.meta.url);
  const rows = readFileSync(file, "utf8")
    .split("\n")
    .filter((l) => l.trim());
  return taskFromRow(JSON.parse(rows[line]), `counter-${line}`);
}

export async function waitFor(predicate, { timeoutMs = 30_000, what = "condition" } = {}) {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const value = await predicate();
    if (value) return value;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  throw new Error(`timed out waiting for ${what}`);
}
