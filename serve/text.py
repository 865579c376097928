"""A completion's text as it is decoded: incremental detokenisation with stop strings
(`TextTracker`), for the streamed chunks and the whole response (serve/app.py)."""


class TextTracker:
    """Incremental detokenisation with stop strings: the text safe to send so far.

    Holds back a trailing partial character and any tail that could begin a stop string;
    when a stop string appears the text is cut before it and `stopped` is set.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False
        self.n_tokens = 0  # tokens whose text is kept (all, unless a stop string cut them)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.ids += tokens
        self.n_tokens = len(self.ids)
        text = self._decode(self.ids)
        hits = [i for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            cut = min(hits)
            self.stopped = True
            n = len(self.ids)
            while n > 0 and len(self._decode(self.ids[: n - 1])) >= cut:
                n -= 1
            self.n_tokens = n
            self.text = text[:cut]
            delta = text[self.sent : cut]
            self.sent = max(self.sent, cut)
            return delta
        hold = 0
        if not final:
            if text.endswith("\ufffd"):
                hold = 1
            for s in self.stops:
                for k in range(min(len(s) - 1, len(text)), hold, -1):
                    if text.endswith(s[:k]):
                        hold = k
                        break
        self.text = text
        safe = len(text) - hold
        delta = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta
