"""The company directory (1 tool) and the email toolkit (6 tools).

Reference quirks kept because they change results: a sent email's id is
`str(int(max(email_id)) + 1)` without zero padding, and the max is a string max, so the
first sent email is "500" and the next "501" (string "500" > "00000499"); sent emails carry
the fixed time `2023-11-30 23:59:00`; search matches every query word anywhere in
subject, body and sender (NaN cells read as "nan"), newest first, 5 per page by default,
with the page number clamped into range; recipients are lower-cased.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from gymrpc.envs.workplace_assistant.tools._base import (
    HARDCODED_CURRENT_TIME,
    Table,
    Toolkit,
    new_row,
    paginate,
    pagination,
)


class CompanyDirectoryTool(Toolkit):
    prefix = "company_directory"
    methods = ("find_email_address",)
    _emails = Table("company_directory._emails")

    def find_email_address(self, name: Any = "") -> Any:
        if name == "":
            return "Name not provided."
        name = name.lower()
        # `str.contains` takes a regular expression, as in the reference: "(" is an error, "." a wildcard.
        found = self._emails[self._emails["email_address"].str.contains(name, case=False)]
        return found["email_address"].values.tolist()


class EmailTool(Toolkit):
    prefix = "email"
    methods = (
        "get_email_information_by_id",
        "search_emails",
        "send_email",
        "delete_email",
        "forward_email",
        "reply_email",
    )
    _emails = Table("email._emails")

    def get_email_information_by_id(self, email_id: Any = None, field: Any = None) -> Any:
        if not email_id:
            return "Email ID not provided."
        if not field:
            return "Field not provided."
        try:
            found = self._records(email_id)
            if not found:
                return "Email not found."
            if field in found[0]:
                return {field: found[0][field]}
            return f"Field '{field}' not found. Available fields: {', '.join(found[0].keys())}"
        except Exception as exc:
            return f"Error retrieving email information: {exc}"

    def search_emails(
        self, query: Any = "", date_min: Any = None, date_max: Any = None, page: Any = 1, page_size: Any = 5
    ) -> Any:
        try:
            words = query.lower().split()

            def matches(row: pd.Series) -> bool:
                text = f"{row['subject']} {row['body']} {row['sender/recipient']}".lower()
                return all(word in text for word in words)

            emails = self._emails
            found = emails[emails.apply(matches, axis=1)].copy()
            found["sent_datetime_tmp"] = pd.to_datetime(found["sent_datetime"])
            found = found.sort_values("sent_datetime_tmp", ascending=False)
            found = found.drop(columns=["sent_datetime_tmp"])
            records = found.to_dict(orient="records")
            if date_min:
                low = pd.Timestamp(date_min).date()
                records = [r for r in records if pd.Timestamp(r["sent_datetime"]).date() >= low]
            if date_max:  # inclusive: compared by date, not time
                high = pd.Timestamp(date_max).date()
                records = [r for r in records if pd.Timestamp(r["sent_datetime"]).date() <= high]
            shown, info = paginate(records, page, page_size)
            if not records:
                return "No emails found."
            return {"emails": shown, "pagination": pagination(info, "total_emails")}
        except Exception as exc:
            return f"Error searching emails: {exc}"

    def send_email(self, recipient: Any = None, subject: Any = None, body: Any = None) -> Any:
        if not recipient or not subject or not body:
            return "Recipient, subject, or body not provided."
        if "@" not in recipient or "." not in recipient:
            return "Invalid recipient email address."
        try:
            recipient = recipient.lower()
            emails = self._emails
            email_id = str(int(emails["email_id"].max()) + 1) if not emails.empty else "1"
            row = new_row(
                {
                    "email_id": email_id,
                    "inbox/outbox": "outbox",
                    "sender/recipient": recipient,
                    "subject": subject,
                    "sent_datetime": str(HARDCODED_CURRENT_TIME),
                    "body": body,
                }
            )
            self._emails = pd.concat([emails, row], ignore_index=True)
            return "Email sent successfully."
        except Exception as exc:
            return f"Error sending email: {exc}"

    def delete_email(self, email_id: Any = None) -> Any:
        if not email_id:
            return "Email ID not provided."
        try:
            emails = self._emails
            if email_id not in emails["email_id"].values:
                return "Email not found."
            self._emails = emails[emails["email_id"] != email_id]
            return "Email deleted successfully."
        except Exception as exc:
            return f"Error deleting email: {exc}"

    def forward_email(self, email_id: Any = None, recipient: Any = None) -> Any:
        if not email_id or not recipient:
            return "Email ID or recipient not provided."
        if "@" not in recipient or "." not in recipient:
            return "Invalid recipient email address."
        try:
            if email_id not in self._emails["email_id"].values:
                return "Email not found."
            recipient = recipient.lower()
            email = self._records(email_id)[0]
            result = self.send_email(recipient, f"FW: {email['subject']}", email["body"])
            if "Error" in result or "Invalid" in result:
                return result
            return "Email forwarded successfully."
        except Exception as exc:
            return f"Error forwarding email: {exc}"

    def reply_email(self, email_id: Any = None, body: Any = None) -> Any:
        if not email_id or not body:
            return "Email ID or body not provided."
        try:
            if email_id not in self._emails["email_id"].values:
                return "Email not found."
            email = self._records(email_id)[0]
            # Inbox or outbox alike, the reply goes to the address in `sender/recipient`.
            result = self.send_email(email["sender/recipient"], f"RE: {email['subject']}", body)
            if "Error" in result or "Invalid" in result:
                return result
            return "Email replied successfully."
        except Exception as exc:
            return f"Error replying to email: {exc}"

    def _records(self, email_id: Any) -> list[dict[str, Any]]:
        emails = self._emails
        return emails[emails["email_id"] == email_id].to_dict(orient="records")
