#!/usr/bin/env node
// gymrpc-node: the Node controller's command line. Every command finds the stack through the
// run folder (--run-dir, $GYMRPC_RUN_DIR or ./.gymrpc), like the Python `gymrpc` command.
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { toJson } from "@bufbuild/protobuf";
import {
  CheckpointIndexSchema,
  CheckpointManifestSchema,
  ParticipantKind,
  ParticipantPhase,
} from "../gen/gymrpc/v1/participant_service_pb.js";
import { Controller, GymClient, episodeId, key, newCheckpointId, readIndex, taskFromRow } from "../src/index.js";

const USAGE = `usage: gymrpc-node [--run-dir DIR] COMMAND ...
  endpoints [PREFIX]                      live endpoints (name, address)
  resolve NAME                            current address of a stable name
  run --agent NAME --tasks FILE [--line N] [--episode ID] [--attempt N] [--policy-version V]
                                          run one task row; prints reward, steps, resume count
  participants                            kind, phase and open checkpoint of every participant (replica)
  checkpoint --dir ROOT [--id ID] [--episode ID:ATTEMPT ...] [--timeout S] [--stop]
                                          prepare, commit into ROOT/ID, index it, resume (--stop: stay closed)
  restore --dir ROOT/ID --episode ID:ATTEMPT ... [--id RESTORE_ID] [--no-resume] [--source NAME=ID,...]
                                          restore an indexed checkpoint into a fresh stack, then resume
                                          (--source: the replicas of NAME that committed; the index is not read)
  inspect ROOT/ID                         the checkpoint's index, every manifest checked (no stack needed)
  resume ID                               resume (or abort) a checkpoint everywhere`;

const OPTIONS = {
  "run-dir": { type: "string" },
  agent: { type: "string", default: "agent/simple" },
  tasks: { type: "string" },
  line: { type: "string", default: "0" },
  episode: { type: "string", multiple: true, default: [] },
  attempt: { type: "string", default: "0" },
  "policy-version": { type: "string", default: "node:0" },
  dir: { type: "string" },
  id: { type: "string" },
  timeout: { type: "string", default: "30" },
  stop: { type: "boolean", default: false },
  "no-resume": { type: "boolean", default: false },
  source: { type: "string", multiple: true, default: [] },
  help: { type: "boolean", short: "h", default: false },
};

async function main(argv) {
  const { values, positionals } = parseArgs({ args: argv, options: OPTIONS, allowPositionals: true });
  const [command, ...rest] = positionals;
  if (values.help || !command) return usage(values.help ? 0 : 2);
  if (command === "inspect") return inspect(required(rest[0], "ROOT/ID"));
  const gym = new GymClient({ runDir: values["run-dir"] });
  try {
    switch (command) {
      case "endpoints":
        for (const e of await gym.endpoints(rest[0] ?? "")) console.log(`${e.name}\t${e.address}`);
        return 0;
      case "resolve":
        console.log(await gym.resolve(required(rest[0], "NAME")));
        return 0;
      case "run":
        return await run(gym, values);
      case "participants":
        return await participants(gym);
      case "checkpoint":
        return await checkpoint(gym, values);
      case "restore":
        return await restore(gym, values);
      case "resume":
        await (await Controller.discover(gym)).resume(required(rest[0], "ID"));
        return 0;
      default:
        return usage(2);
    }
  } finally {
    gym.close();
  }
}

async function run(gym, values) {
  const rows = readFileSync(required(values.tasks, "--tasks"), "utf8")
    .split("\n")
    .filter((l) => l.trim());
  const line = Number(values.line);
  const task = taskFromRow(JSON.parse(rows[line]), String(line));
  const trajectory = await gym.run(task, {
    agent: values.agent,
    episodeId: episodeId(values.episode[0] ?? `node-${Date.now()}`, Number(values.attempt)),
    policyVersion: values["policy-version"],
  });
  const { rolloutId, attempt } = trajectory.episodeId;
  console.log(
    JSON.stringify({
      episode: `${rolloutId}/a${attempt}`,
      reward: trajectory.reward,
      steps: trajectory.steps,
      tool_calls: trajectory.toolCalls.length,
      resume_count: trajectory.resumeCount,
    }),
  );
  return 0;
}

async function participants(gym) {
  const controller = await Controller.discover(gym);
  for (const [name, status] of await controller.status()) {
    const open = status.checkpointId ? `\t${status.checkpointId}` : "";
    console.log(`${name}\t${ParticipantKind[status.kind]}\t${ParticipantPhase[status.phase]}${open}`);
  }
  return 0;
}

async function checkpoint(gym, values) {
  const controller = await Controller.discover(gym);
  const result = await controller.checkpoint(required(values.dir, "--dir"), {
    checkpointId: values.id ?? newCheckpointId(),
    episodeIds: values.episode.length ? values.episode.map(parseEpisode) : undefined,
    timeoutMs: Number(values.timeout) * 1000,
    stop: values.stop,
  });
  const manifests = [...result.manifests].map(([name, m]) => [
    name,
    toJson(CheckpointManifestSchema, m, { useProtoFieldName: true }),
  ]);
  const blockers = [...result.prepare.blockers()].map(([name, ids]) => [name, ids.map(key)]);
  const report = {
    checkpoint_id: result.checkpointId,
    checkpoint_dir: result.checkpointDir,
    committed: result.committed,
    blockers: Object.fromEntries(blockers),
    restarted: result.restarted.map(key),
    manifests: Object.fromEntries(manifests),
    index: result.index && toJson(CheckpointIndexSchema, result.index, { useProtoFieldName: true }),
  };
  console.log(JSON.stringify(report, null, 2));
  return result.committed ? 0 : 1;
}

async function restore(gym, values) {
  const controller = await Controller.discover(gym);
  const restoreId = values.id ?? newCheckpointId("restore");
  const episodeIds = values.episode.map(parseEpisode);
  const sources = values.source.length ? Object.fromEntries(values.source.map(parseSource)) : undefined;
  const checkpointDir = required(values.dir, "--dir");
  const replies = await controller.restore(restoreId, { checkpointDir, episodeIds, sources });
  if (!values["no-resume"]) await controller.resume(restoreId);
  for (const [name, reply] of replies) console.log(`${name}\t${reply.restored.map(key).join(" ")}`);
  return 0;
}

/** Print a checkpoint's index as JSON once every manifest it lists checks out; exit 1 if a restore would refuse it. */
function inspect(checkpointDir) {
  const index = readIndex(checkpointDir);
  console.log(JSON.stringify(toJson(CheckpointIndexSchema, index, { useProtoFieldName: true }), null, 2));
  return 0;
}

function parseSource(text) {
  const match = /^([^=]+)=([A-Za-z0-9][A-Za-z0-9._,-]*)$/.exec(text);
  if (!match) throw new Error(`--source ${JSON.stringify(text)} must be NAME=ID[,ID...]`);
  return [match[1], match[2].split(",")];
}

function parseEpisode(text) {
  const match = /^(.+):(\d+)$/.exec(text);
  if (!match) throw new Error(`--episode ${JSON.stringify(text)} must be ROLLOUT_ID:ATTEMPT`);
  return episodeId(match[1], Number(match[2]));
}

function required(value, what) {
  if (value === undefined) throw new Error(`${what} is required\n${USAGE}`);
  return value;
}

function usage(code) {
  (code ? console.error : console.log)(USAGE);
  return code;
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err) => {
    console.error(`gymrpc-node: ${err}`);
    process.exit(1);
  },
);
