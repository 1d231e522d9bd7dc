// Lists the served models with the Node SDK; prints {"ids": [...]} as JSON.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY });
const ids = [];
for await (const model of client.models.list()) ids.push(model.id);
console.log(JSON.stringify({ ids }));
