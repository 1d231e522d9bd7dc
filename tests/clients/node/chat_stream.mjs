// Chats streamed with the Node SDK (client.chat.completions.create({stream: true})), each
// beside the same request unstreamed: a forced tool call (tool_choice "required"), forced
// calls cut by max_tokens, and an answer with logprobs. Prints, per case, every streamed
// choice delta (with its finish_reason and logprob tokens) and the unstreamed choice, as JSON.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY, maxRetries: 0 });
const base = { model: process.env.MODEL, messages: [{ role: "user", content: "Ship my order fast." }], temperature: 0 };
const ship = {
  type: "function",
  function: {
    name: "ship",
    description: "Ship an order.",
    parameters: {
      type: "object",
      properties: { speed: { enum: ["slow", "fast"] }, boxes: { type: "integer", minimum: 1, maximum: 9 } },
      required: ["speed", "boxes"],
      additionalProperties: false,
    },
  },
};
const cases = {
  required: { ...base, tools: [ship], tool_choice: "required", parallel_tool_calls: false, max_tokens: 128 },
  cut: { ...base, tools: [ship], tool_choice: "required", max_tokens: 30 },
  logprobs: { ...base, logprobs: true, top_logprobs: 2, max_tokens: 12 },
};

async function streamed(request) {
  const events = [];
  const stream = await client.chat.completions.create({ ...request, stream: true });
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      events.push({
        index: choice.index,
        delta: choice.delta,
        finish_reason: choice.finish_reason,
        logprobs: choice.logprobs?.content?.map((entry) => entry.token) ?? null,
      });
    }
  }
  return events;
}

const out = {};
for (const [name, request] of Object.entries(cases)) {
  const whole = await client.chat.completions.create(request);
  out[name] = { stream: await streamed(request), whole: whole.choices[0] };
}
console.log(JSON.stringify(out));
