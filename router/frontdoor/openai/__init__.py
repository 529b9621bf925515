"""The OpenAI API's shapes: request bodies (``schema``), response bodies (``render``) and how one
request becomes a streamed or whole HTTP response (``responder``)."""
