// Tasks from the reference's JSONL rows, as `gymrpc.messages.task_from_row` builds them:
// `responses_create_params.input` opens the conversation, `.tools` are offered to the model,
// and every other key (except `agent_ref` and `_ng_*`) is the environment's, sent as JSON text.
import { create } from "@bufbuild/protobuf";
import { Role, TaskSchema } from "../gen/gymrpc/v1/common_pb.js";

const ROLES = {
  system: Role.SYSTEM,
  user: Role.USER,
  assistant: Role.ASSISTANT,
  tool: Role.TOOL,
  developer: Role.DEVELOPER,
};
const NOT_FIELDS = new Set(["responses_create_params", "agent_ref"]);

/**
 * A `gymrpc.v1.Task` from one task row.
 * @param {Record<string, any>} row a parsed JSONL row
 * @param {string} [taskId] used when the row has no `task_id`
 */
export function taskFromRow(row, taskId = "") {
  const params = row?.responses_create_params;
  if (!params || typeof params !== "object" || !("input" in params)) {
    throw new Error("task row needs a 'responses_create_params' object with an 'input'");
  }
  const input = typeof params.input === "string" ? [{ role: "user", content: params.input }] : params.input;
  const fields = Object.fromEntries(
    Object.entries(row).filter(([key]) => !NOT_FIELDS.has(key) && !key.startsWith("_ng_")),
  );
  const sampling = {};
  if (params.temperature != null) sampling.temperature = Number(params.temperature);
  if (params.top_p != null) sampling.topP = Number(params.top_p);
  if (params.max_output_tokens) sampling.maxTokens = Number(params.max_output_tokens);
  return create(TaskSchema, {
    taskId: String(row.task_id ?? taskId),
    input: input.map((message, index) => toMessage(message, index)),
    tools: (params.tools ?? []).map((tool) => {
      const fn = tool.function ?? tool;
      return {
        name: fn.name,
        description: fn.description ?? "",
        parametersJsonSchema: canonicalJson(fn.parameters ?? {}),
        strict: Boolean(fn.strict),
      };
    }),
    envJson: canonicalJson(fields),
    sampling,
  });
}

function toMessage(message, index) {
  const role = ROLES[message.role];
  if (role === undefined) throw new Error(`input[${index}] has role ${JSON.stringify(message.role)}`);
  const content = Array.isArray(message.content)
    ? message.content.map((part) => part.text ?? "").join("")
    : String(message.content ?? "");
  return { role, content };
}

/** JSON with sorted keys, so that one task always has one fingerprint. */
export function canonicalJson(value) {
  return JSON.stringify(sortKeys(value));
}

function sortKeys(value) {
  if (Array.isArray(value)) return value.map(sortKeys);
  if (value && typeof value === "object") {
    return Object.fromEntries(
      Object.keys(value)
        .sort()
        .map((key) => [key, sortKeys(value[key])]),
    );
  }
  return value;
}
