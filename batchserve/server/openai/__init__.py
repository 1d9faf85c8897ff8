"""The OpenAI HTTP API's wing: completions, chat, the Responses API, tools, and their request
bodies and answers, over the shared `Frontend`."""
