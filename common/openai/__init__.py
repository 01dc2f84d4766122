"""OpenAI's API as Spillway speaks it: request validation, chat prompts and images, the Responses API's
mapping, tool calls and reasoning blocks read back from the generated text."""
