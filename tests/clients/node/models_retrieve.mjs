// Retrieves one model card with the Node SDK, and an unknown id with a slash in it; prints
// {"card": {...}, "missing": {"status", "code"}} as JSON.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY });
const card = await client.models.retrieve(process.env.MODEL);
let missing = null;
try {
  await client.models.retrieve("org/not-served");
} catch (error) {
  missing = { status: error.status, code: error.code, message: error.message };
}
console.log(JSON.stringify({ card, missing }));
