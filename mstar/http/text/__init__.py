"""Text generation over HTTP: the OpenAI routes (`/v1/models`,
`/v1/completions`, `/v1/chat/completions`) and the native `/generate`, the
parsing of their bodies and chat messages, and the shapes of logprobs."""
