"""`dgemma serve`: the continuous-batching engine (`engine`), the OpenAI request rules (`api`), chat templates and
the output parser (`templates`) and the HTTP app (`app`). docs/serving.md describes the server; importing this
package imports none of them (the HTTP stack is the optional `serve` extra)."""
