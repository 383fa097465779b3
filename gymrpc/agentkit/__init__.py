"""Bring your own agent: one async function, served as a resumable `AgentService`.

    async def solve(episode: agentkit.Episode) -> str:
        messages = list(episode.messages)
        while True:
            reply = await episode.client.chat.completions.create(
                model=episode.model, messages=messages, tools=episode.tools
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                output = await episode.call_tool(call)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})

`episode.client` is an `openai.AsyncOpenAI` already pointed at the model role's OpenAI front
door, with the episode and this run baked into its headers; `episode.call_tool` runs a
tool in the episode's resources session. Serve it with
`role: agent, args: {entrypoint: mypkg.agents:solve}` in a stack (or
`python -m gymrpc.servers.agent --entrypoint mypkg.agents:solve`).

A `Run` retried after the agent process died runs the function again from the start; the
model role answers its recorded calls from the record and the resources role returns the
recorded result of every known call id, so nothing is generated or applied twice and the
run goes live at the first call past the record. The function must be deterministic given
the responses it gets (as a Temporal workflow must); one that is not fails with
REPLAY_DIVERGENCE unless it opted into `divergence="go_live"`. The resources role answers
REPLAY_DIVERGENCE to a tool call the earlier run did not make (another call under a recorded
id, or a new call while recorded ones are not repeated yet), since the session holds the
earlier run's effects: the run fails, or with go_live runs again in a fresh session.
"""

from gymrpc.agentkit.episode import Episode, ToolCaller, ToolOutput

__all__ = ["Episode", "ToolCaller", "ToolOutput"]
