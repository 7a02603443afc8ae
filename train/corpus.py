"""A synthetic movie-review corpus, generated from a seed, so training works offline.

The reviews carry a real but imperfect signal, like IMDB: sentiment words of different
strengths, negation that flips them ("not boring"), mixed reviews that praise one thing and pan
another, plot filler, typos, case and punctuation noise, and a few percent of wrong labels. A
bag-of-words model learns it well but not perfectly. Everything comes from one
`random.Random(seed)`, so a seed always gives the same corpus, in any process.
"""

from __future__ import annotations

import math
import random

N_TRAIN = 5000
N_TEST = 2000
LABEL_NOISE = 0.03
MIN_WORDS, MAX_WORDS = 10, 200

# Sentiment adjectives by polarity (1 positive, 0 negative) and strength (weak, medium, strong).
ADJECTIVES = {
    1: (
        "good decent nice fine solid pleasant watchable competent likable fair agreeable "
        "respectable".split(),
        "great excellent wonderful enjoyable gripping moving delightful charming clever engaging "
        "impressive beautiful funny touching compelling memorable fresh witty powerful "
        "captivating".split(),
        "brilliant superb outstanding magnificent stunning flawless extraordinary phenomenal "
        "breathtaking unforgettable sublime exceptional".split(),
    ),
    0: (
        "mediocre uneven flat slow underwhelming average ordinary thin overlong disappointing "
        "generic forced".split(),
        "bad boring dull tedious clumsy bland forgettable predictable messy lifeless pointless "
        "silly annoying shallow weak confusing lazy cheap stale cliched".split(),
        "awful terrible atrocious unwatchable abysmal dreadful horrendous appalling painful "
        "insufferable pathetic laughable".split(),
    ),
}
PHRASES = {
    1: [
        "I loved every minute of it", "I would happily watch it again", "highly recommended",
        "one of the best films I have seen this year", "it kept me on the edge of my seat",
        "the time flew by", "a must see", "I was moved to tears", "worth every penny",
        "I can't wait to see it again", "it won me over", "easily a favorite",
    ],
    0: [
        "I want those two hours back", "a complete waste of time", "I nearly fell asleep",
        "I walked out halfway through", "avoid at all costs",
        "one of the worst films I have seen this year", "I kept checking my watch",
        "save your money", "I regret watching it", "what a letdown", "skip this one",
        "it made me cringe",
    ],
}
ASPECTS = [
    "acting", "performances", "lead", "script", "dialogue", "plot", "pacing", "cinematography",
    "score", "soundtrack", "ending", "direction", "editing", "effects", "characters", "humor",
    "story", "cast", "visuals", "twist", "writing", "villain", "romance", "finale", "premise",
    "production design", "camera work",
]
PLURAL = {"performances", "effects", "characters", "visuals"}
INTENSIFIERS = ["", "", "", "very", "really", "quite", "truly", "absolutely", "pretty",
                "rather", "fairly", "incredibly", "somewhat", "extremely", "genuinely", "simply"]
NEGATORS = ["not", "never", "hardly", "not at all", "by no means", "far from", "not really",
            "not exactly"]

FIRST = ("Anna Ben Carla David Elena Frank Grace Hugo Irene Jack Kira Leo Maya Nick Olga Paul "
         "Quinn Rosa Sam Tara Umar Vera Walt Xena Yuri Zoe Omar Lena Ivan Nora").split()
LAST = ("Adams Brooks Chen Diaz Evans Fischer Garcia Hughes Ito Jensen Kowalski Lopez Moreau "
        "Novak Okafor Patel Rossi Silva Tanaka Ulrich Volkov Weber Young Zimmer Larsen Haddad "
        "Byrne Costa").split()
GENRES = ("thriller comedy drama western horror musical documentary romance war heist sci-fi "
          "fantasy mystery biopic noir adventure satire").split()
CHARACTERS = [
    "a retired detective", "a young nurse", "an estranged brother", "a struggling musician",
    "a small-town sheriff", "a widowed farmer", "a teenage hacker", "an aging boxer",
    "a ship captain", "a school teacher", "a disgraced lawyer", "a petty thief",
    "a lonely astronaut", "a village doctor", "a rookie reporter", "an old baker",
]
PLOTS = [
    "who must find a missing daughter", "who inherits an old house", "who plans one last job",
    "who is hiding a secret", "who returns home after twenty years", "who falls for a stranger",
    "who uncovers a conspiracy", "who tries to save a failing business",
    "who is hunted by a rival gang", "who travels across the country", "who enters a contest",
    "who witnesses a crime",
]
SETTINGS = [
    "a small town in Ohio", "1970s Tokyo", "a space station", "a Victorian manor",
    "the Scottish highlands", "a New York diner", "a fishing village", "postwar Berlin",
    "a desert outpost", "a high school", "a cruise ship", "a mountain monastery", "Paris",
    "a hospital in Lagos", "the Australian outback", "a mining colony on Mars",
]
SOURCES = ["a novel", "a true story", "a comic book", "a stage play", "a short story",
           "an old radio serial"]
COMPANY = ["my wife", "my husband", "a friend", "my kids", "my parents", "my sister",
           "the whole family", "a date", "my roommate", "nobody"]
WHEN = ["last weekend", "on a flight", "on TV", "at a festival", "last night", "in the cinema",
        "on a rainy Sunday", "on DVD", "years ago"]


def generate(seed: int = 0) -> tuple[list[str], list[int], list[str], list[int]]:
    """Return (train texts, train labels, test texts, test labels); no text is in both."""
    rng = random.Random(seed)
    seen: set[str] = set()
    texts: list[str] = []
    labels: list[int] = []
    while len(texts) < N_TRAIN + N_TEST:
        # Alternate true sentiment for balanced classes; the observed label is sometimes wrong.
        sentiment = len(texts) % 2
        text = _review(rng, sentiment)
        if text in seen:
            continue
        seen.add(text)
        texts.append(text)
        labels.append(sentiment if rng.random() >= LABEL_NOISE else 1 - sentiment)
    order = list(range(len(texts)))
    rng.shuffle(order)
    texts = [texts[i] for i in order]
    labels = [labels[i] for i in order]
    return texts[:N_TRAIN], labels[:N_TRAIN], texts[N_TRAIN:], labels[N_TRAIN:]


def _review(rng: random.Random, sentiment: int) -> str:
    """One review: filler and opinions until a length drawn per review, maybe a verdict."""
    target = min(MAX_WORDS, max(MIN_WORDS, int(rng.lognormvariate(math.log(60), 0.7))))
    one_sided = rng.uniform(0.8, 1.0)  # how often an opinion agrees with the sentiment
    opinion_rate = rng.uniform(0.3, 0.7)
    sentences = [_intro(rng)] if rng.random() < 0.4 else []
    length = sum(len(s.split()) for s in sentences)
    opinions = 0
    while length < target:
        if rng.random() < opinion_rate or (opinions == 0 and length > target // 2):
            agrees = rng.random() < one_sided
            sentence = _opinion(rng, sentiment if agrees else 1 - sentiment, strong=agrees)
            opinions += 1
        else:
            sentence = _filler(rng)
        if length + len(sentence.split()) > MAX_WORDS:
            break
        sentences.append(sentence)
        length += len(sentence.split())
    verdict = _verdict(rng, sentiment if rng.random() < 0.9 else 1 - sentiment)
    if rng.random() < 0.6 and length + len(verdict.split()) <= MAX_WORDS:
        sentences.append(verdict)
    return _noisy(rng, " ".join(sentences))


def _adjective(rng: random.Random, polarity: int, strong: bool) -> str:
    """A sentiment adjective; strong ones mostly where the opinion matches the review."""
    weights = (3, 4, 3) if strong else (6, 3, 1)
    words = rng.choices(ADJECTIVES[polarity], weights)[0]
    return rng.choice(words)


def _opinion(rng: random.Random, polarity: int, strong: bool) -> str:
    """A sentence expressing `polarity`, about one aspect or the whole film."""
    aspect, verb = _aspect(rng)
    adj = _adjective(rng, polarity, strong)
    opposite = _adjective(rng, 1 - polarity, False)
    kind = rng.random()
    if kind < 0.30:
        words = [aspect.capitalize(), verb, rng.choice(INTENSIFIERS), adj]
        return " ".join(w for w in words if w) + "."
    if kind < 0.45:  # negation: a word of the other polarity, flipped
        if rng.random() < 0.3:
            return f"{aspect.capitalize()} {verb}n't {opposite} at all."
        return f"{aspect.capitalize()} {verb} {rng.choice(NEGATORS)} {opposite}."
    if kind < 0.55:
        other, other_verb = _aspect(rng)
        return f"{rng.choice(['While', 'Although', 'Even if'])} {aspect} {verb} {opposite}, " \
               f"{other} {other_verb} {adj}."
    if kind < 0.65:
        return f"{_name(rng)} gives {_a(adj)} performance as {rng.choice(CHARACTERS)}."
    if kind < 0.75:
        film = rng.choice(["movie", "film", "picture", rng.choice(GENRES)])
        return f"{rng.choice(['This', 'It', 'Honestly, this'])} {rng.choice(['is', 'was'])} " \
               f"{_a(adj)} {film}."
    if kind < 0.85:
        return f"{rng.choice(PHRASES[polarity]).capitalize()}{rng.choice(['.', '!'])}"
    if kind < 0.92:  # a denied experience, or a denied expectation
        if polarity == 0:
            return f"I {rng.choice(['did not', 'didnt', 'could not'])} " \
                   f"{rng.choice(['enjoy', 'like', 'love', 'care about'])} {aspect}."
        return rng.choice(["I could not stop watching.", "I never once got bored.",
                           f"I did not expect to like {aspect} this much."])
    return f"Critics called it {opposite}, but I found it {adj}."


def _verdict(rng: random.Random, polarity: int) -> str:
    """A closing line: a summary word, phrase or rating."""
    if rng.random() < 0.4:
        score = rng.randint(6, 10) if polarity else rng.randint(1, 5)
        return rng.choice([f"{score}/10.", f"Rating: {score} out of 10.", f"{score} out of ten."])
    if rng.random() < 0.5:
        return f"Overall, {rng.choice(PHRASES[polarity])}."
    return f"{rng.choice(['Overall', 'In the end', 'All in all', 'Bottom line'])}: " \
           f"{_adjective(rng, polarity, True)}."


def _filler(rng: random.Random) -> str:
    """A sentiment-free sentence about plot, cast or setting."""
    kind = rng.randrange(7)
    if kind == 0:
        return f"The {rng.choice(GENRES)} follows {rng.choice(CHARACTERS)} {rng.choice(PLOTS)}."
    if kind == 1:
        return f"It is set in {rng.choice(SETTINGS)} in {rng.randint(1890, 2030)}."
    if kind == 2:
        return f"It was directed by {_name(rng)} and stars {_name(rng)} and {_name(rng)}."
    if kind == 3:
        return f"{_name(rng)} plays {rng.choice(CHARACTERS)} {rng.choice(PLOTS)}."
    if kind == 4:
        return f"It is based on {rng.choice(SOURCES)} by {_name(rng)}."
    if kind == 5:
        return f"There is a long scene in {rng.choice(SETTINGS)} where {rng.choice(CHARACTERS)} " \
               f"meets {rng.choice(CHARACTERS)}."
    return f"It runs about {rng.randint(80, 190)} minutes and was shot in {rng.choice(SETTINGS)}."


def _aspect(rng: random.Random) -> tuple[str, str]:
    """An aspect of the film and a verb that agrees with it."""
    noun = rng.choice(ASPECTS)
    return f"the {noun}", rng.choice(["were", "are"] if noun in PLURAL else ["was", "is"])


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _intro(rng: random.Random) -> str:
    return f"I watched this {rng.choice(GENRES)} {rng.choice(WHEN)} with {rng.choice(COMPANY)}."


def _name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _noisy(rng: random.Random, text: str) -> str:
    """Typos, shouting, lower case and extra punctuation, as in real user reviews."""
    words = text.split()
    typo_rate = rng.choice([0.0, 0.01, 0.03, 0.06])
    for i, word in enumerate(words):
        if len(word) > 3 and rng.random() < typo_rate:
            words[i] = _typo(rng, word)
    text = " ".join(words)
    style = rng.random()
    if style < 0.15:
        text = text.lower()
    elif style < 0.2:
        text = text.upper()
    if rng.random() < 0.2:
        text = text.replace(".", rng.choice(["!", "!!", "..."]))
    return text


def _typo(rng: random.Random, word: str) -> str:
    i = rng.randrange(1, len(word) - 1)
    op = rng.randrange(4)
    if op == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if op == 1:
        return word[:i] + word[i + 1:]
    if op == 2:
        return word[:i] + word[i] + word[i:]
    return word[:i] + rng.choice("abcdefghijklmnopqrstuvwxyz") + word[i + 1:]
