// The Responses API with the Node SDK: one greedy `responses.create`, then the same request
// through `responses.stream`; prints both answers, the event types and the joined deltas as JSON.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY, maxRetries: 0 });
const request = { model: process.env.MODEL, input: "Count to three.", instructions: "Be brief.",
                  max_output_tokens: 10, temperature: 0 };

const created = await client.responses.create(request);
const events = [];
let deltas = "";
const stream = client.responses.stream(request);
for await (const event of stream) {
  events.push(event.type);
  if (event.type === "response.output_text.delta") deltas += event.delta;
}
const streamed = await stream.finalResponse();
const summary = (r) => ({ id: r.id, status: r.status, text: r.output_text, usage: r.usage,
                          items: r.output.map((item) => item.type) });
console.log(JSON.stringify({ created: summary(created), streamed: summary(streamed), events, deltas }));
