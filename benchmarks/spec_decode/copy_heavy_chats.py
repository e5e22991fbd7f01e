"""Copy-heavy chats: requests whose replies mostly repeat text from the prompt.

Editing, reformatting and quoting are where drafting from the request's own tokens pays off
(n-gram prompt lookup, suffix decoding): most of the reply's next tokens already occur in the
prompt. Eight tasks, four payloads each; `copy_heavy_conversations` interleaves the tasks so
that any prefix of the list covers every task as evenly as its length allows.
"""

from __future__ import annotations

from dataclasses import dataclass

Message = dict[str, str]


@dataclass(slots=True, frozen=True)
class ChatTask:
    """One kind of request: the user's message is `template` with one of `payloads` in place
    of its `{payload}` (a payload may hold braces of its own: code, JSON)."""

    name: str
    template: str
    payloads: tuple[str, ...]

    def conversation(self, payload_index: int) -> list[Message]:
        content = self.template.replace("{payload}", self.payloads[payload_index])
        return [{"role": "user", "content": content}]


COPY_HEAVY_TASKS = (
    ChatTask(
        "rename-variable",
        "Here is some code:\n\n{payload}",
        (
            "```python\n"
            "def summarize(data):\n"
            "    total = 0\n"
            "    for item in data:\n"
            "        total += item.amount\n"
            "    average = total / len(data) if data else 0.0\n"
            "    return {'count': len(data), 'total': total, 'average': average}\n"
            "```\n\nRewrite it with the variable `data` renamed to `records`.",
            "```python\n"
            "def read_lines(path):\n"
            "    tmp = []\n"
            "    with open(path) as handle:\n"
            "        for line in handle:\n"
            "            tmp.append(line.rstrip('\\n'))\n"
            "    return tmp\n"
            "```\n\nRewrite it with the variable `tmp` renamed to `lines`.",
            "```javascript\n"
            "function fetchWithRetry(url, n) {\n"
            "  for (let i = 0; i < n; i++) {\n"
            "    const response = tryFetch(url);\n"
            "    if (response.ok) return response;\n"
            "    console.log(`attempt ${i + 1} of ${n} failed`);\n"
            "  }\n"
            "  throw new Error(`gave up after ${n} attempts`);\n"
            "}\n"
            "```\n\nRewrite it with the variable `n` renamed to `maxRetries`.",
            "```python\n"
            "def apply_discount(x, percent):\n"
            "    if x < 0:\n"
            "        raise ValueError('x must not be negative')\n"
            "    discounted = x - x * percent / 100\n"
            "    return round(discounted, 2)\n"
            "```\n\nRewrite it with the variable `x` renamed to `price`.",
        ),
    ),
    ChatTask(
        "sort-list",
        "Sort this list alphabetically. Reply with the sorted list only, one item per line."
        "\n\n{payload}",
        (
            "banana\ncherry\napple\nmango\nblueberry\nkiwi\ngrape\npeach\nlemon\napricot",
            "Oslo\nMadrid\nBerlin\nVienna\nAthens\nDublin\nLisbon\nPrague\nWarsaw\nBudapest",
            "Tuesday meeting\nMonday standup\nFriday review\nThursday demo\nWednesday planning",
            "violin\ncello\nflute\noboe\ntrumpet\nclarinet\nharp\npiano\ndrums\nbassoon",
        ),
    ),
    ChatTask(
        "format-sql",
        "Reformat this SQL query: one clause per line, keywords in upper case. Reply with the "
        "query only.\n\n{payload}",
        (
            "select id, name, email from users where active = 1 and created_at > '2024-01-01' "
            "order by name limit 50",
            "select o.id, o.total, c.name from orders o join customers c on c.id = o.customer_id "
            "where o.total > 100 order by o.total desc",
            "select department, count(*) as employees, avg(salary) as average_salary from staff "
            "group by department having count(*) > 5 order by average_salary desc",
            "update products set price = price * 1.1, updated_at = now() where category = "
            "'books' and stock > 0",
        ),
    ),
    ChatTask(
        "format-json",
        "Pretty-print this JSON with an indent of two spaces. Reply with the JSON only."
        "\n\n{payload}",
        (
            '{"name":"Ada Lovelace","born":1815,"fields":["mathematics","computing"],'
            '"address":{"city":"London","country":"UK"}}',
            '{"order":1042,"items":[{"sku":"A-17","qty":2,"price":9.5},{"sku":"B-3","qty":1,'
            '"price":24.0}],"paid":true,"notes":null}',
            '{"server":{"host":"0.0.0.0","port":8080},"database":{"url":"postgres://db/app",'
            '"pool":10},"debug":false}',
            '{"title":"Dune","author":"Frank Herbert","year":1965,"tags":["science fiction",'
            '"classic"],"rating":4.6}',
        ),
    ),
    ChatTask(
        "fix-spelling",
        "Fix the spelling mistakes in this paragraph. Reply with the corrected paragraph only."
        "\n\n{payload}",
        (
            "The comittee will recieve the final report next wensday. Please make sure that "
            "every section is complet and that the refrences are acurate before you submit it.",
            "Our garden is beautifull in the spring. The tulips and the dafodils bloom first, "
            "and then the roses folow in early sumer when the wether gets warmer.",
            "The libary is closed on sundays, but you can return your books at the drop box "
            "next to the enterance. Late fees are charged for every aditional day.",
            "Yesterday I went to the restaraunt on the corner with my frends. The food was "
            "delicous, but the servise was slow and the desert arrived cold.",
        ),
    ),
    ChatTask(
        "quote-paragraph",
        "Quote this paragraph back to me exactly, word for word, without any comment.\n\n{payload}",
        (
            "The river runs through the middle of the old town. On both banks, narrow streets "
            "climb towards the hills, and every evening the bells of the church ring out over "
            "the water while the fishermen bring their boats home.",
            "To install the software, download the archive, unpack it into a folder of your "
            "choice, and run the setup script from a terminal. The script checks your system "
            "and asks before it changes anything.",
            "Every member of the team is responsible for the quality of the product. Reviews "
            "are not a formality: read the change, run it, and say what you would do "
            "differently before you approve it.",
            "The museum opens at nine in the morning and closes at six in the evening. Guided "
            "tours start every hour from the main hall, and tickets can be bought at the door "
            "or online.",
        ),
    ),
    ChatTask(
        "list-to-table",
        "Convert this list into a markdown table with a header row. Reply with the table only."
        "\n\n{payload}",
        (
            "- Alice, 34, engineer, Berlin\n- Bob, 28, designer, Paris\n- Carol, 45, manager, "
            "Rome\n- Dave, 39, analyst, Madrid",
            "- Mercury: 0.39 AU, 88 days\n- Venus: 0.72 AU, 225 days\n- Earth: 1.00 AU, 365 "
            "days\n- Mars: 1.52 AU, 687 days",
            "- Python 3.11, released 2022\n- Python 3.12, released 2023\n- Python 3.13, "
            "released 2024\n- Python 3.14, released 2025",
            "- flour: 500 g\n- sugar: 200 g\n- butter: 250 g\n- eggs: 3\n- milk: 100 ml",
        ),
    ),
    ChatTask(
        "csv-to-json",
        "Convert this CSV into a JSON array of objects, one object per row. Reply with the "
        "JSON only.\n\n{payload}",
        (
            "id,name,city\n1,Anna,Berlin\n2,Ben,Hamburg\n3,Clara,Munich",
            "product,price,stock\npen,1.50,120\nnotebook,3.20,45\nstapler,7.99,12",
            "date,temperature,rain\n2024-06-01,21,no\n2024-06-02,18,yes\n2024-06-03,24,no",
            "country,capital,population\nFrance,Paris,68\nSpain,Madrid,48\nItaly,Rome,59",
        ),
    ),
)

MAX_PAYLOADS_PER_TASK = min(len(task.payloads) for task in COPY_HEAVY_TASKS)


def copy_heavy_conversations(num_per_task: int) -> list[tuple[str, list[Message]]]:
    """(task name, conversation) pairs, `num_per_task` per task, interleaved task by task.

    Raises ValueError when a task has fewer payloads than asked."""
    if not 1 <= num_per_task <= MAX_PAYLOADS_PER_TASK:
        raise ValueError(
            f"num_per_task must be in [1, {MAX_PAYLOADS_PER_TASK}] (the payloads each task "
            f"has), got {num_per_task}"
        )
    return [
        (task.name, task.conversation(index))
        for index in range(num_per_task)
        for task in COPY_HEAVY_TASKS
    ]
