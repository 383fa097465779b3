"""The CRM toolkit (4 tools).

Reference quirks kept: a new customer id is `str(int(max) + 1).zfill(8)` ("00000200"
first); fields left out of `add_customer` are stored as None, while cells empty in the CSV
are NaN (the difference a snapshot must keep); `notes` defaults to ""; text filters are
case-insensitive regular expressions without `na=False` (so filtering a column holding a
missing value fails); date bounds compare strings; 5 per page, page clamped into range.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from gymrpc.envs.workplace_assistant.tools._base import Table, Toolkit, new_row, paginate, pagination

_STATUSES = ["Qualified", "Won", "Lost", "Lead", "Proposal"]
_PRODUCTS = ["Software", "Hardware", "Services", "Consulting", "Training"]
_TEXT_FILTERS = ("customer_name", "customer_email", "product_interest", "status", "assigned_to_email")


class CustomerRelationshipManagerTool(Toolkit):
    prefix = "customer_relationship_manager"
    methods = ("search_customers", "update_customer", "add_customer", "delete_customer")
    _crm_data = Table("customer_relationship_manager._crm_data")

    def search_customers(
        self,
        customer_name: Any = None,
        customer_email: Any = None,
        product_interest: Any = None,
        status: Any = None,
        assigned_to_email: Any = None,
        last_contact_date_min: Any = None,
        last_contact_date_max: Any = None,
        follow_up_by_min: Any = None,
        follow_up_by_max: Any = None,
        page: Any = 1,
        page_size: Any = 5,
    ) -> Any:
        customers = self._crm_data.copy()
        text = {
            "customer_name": customer_name,
            "customer_email": customer_email,
            "product_interest": product_interest,
            "status": status,
            "assigned_to_email": assigned_to_email,
        }
        bounds = [last_contact_date_min, last_contact_date_max, follow_up_by_min, follow_up_by_max]
        if not any([*text.values(), *bounds]):
            return "No search parameters provided. Please provide at least one parameter."
        for column in _TEXT_FILTERS:
            if text[column]:
                customers = customers[customers[column].str.contains(text[column], case=False)]
        if last_contact_date_min:
            customers = customers[customers["last_contact_date"] >= last_contact_date_min]
        if last_contact_date_max:
            customers = customers[customers["last_contact_date"] <= last_contact_date_max]
        if follow_up_by_min:
            customers = customers[customers["follow_up_by"] >= follow_up_by_min]
        if follow_up_by_max:
            customers = customers[customers["follow_up_by"] <= follow_up_by_max]
        records = customers.to_dict(orient="records")
        shown, info = paginate(records, page, page_size)
        if not records:
            return "No customers found."
        return {"customers": shown, "pagination": pagination(info, "total_customers")}

    def update_customer(self, customer_id: Any = None, field: Any = None, new_value: Any = None) -> Any:
        if not customer_id or not field or not new_value:
            return "Customer ID, field, or new value not provided."
        if field == "status" and new_value not in _STATUSES:
            return "Status not valid. Please choose from: 'Qualified', 'Won', 'Lost', 'Lead', 'Proposal'"
        if field == "product_interest" and new_value not in _PRODUCTS:
            return (
                "Product interest not valid. Please choose from: 'Software', 'Hardware', 'Services', 'Consulting', "
                "'Training'"
            )
        if field in ["customer_email", "assigned_to_email"]:
            new_value = new_value.lower()
        customers = self._crm_data
        if customer_id not in customers["customer_id"].values:
            return "Customer not found."
        if field not in customers.columns:
            return (
                "Field not valid. Please choose from: 'customer_name', 'assigned_to_email', 'customer_email', "
                "'customer_phone', 'last_contact_date', 'product_interest', 'status', 'notes', 'follow_up_by'"
            )
        customers = customers.copy(deep=False)
        customers.loc[customers["customer_id"] == customer_id, field] = new_value
        self._crm_data = customers
        return "Customer updated successfully."

    def add_customer(
        self,
        customer_name: Any = None,
        assigned_to_email: Any = None,
        status: Any = None,
        customer_email: Any = None,
        customer_phone: Any = None,
        last_contact_date: Any = None,
        product_interest: Any = None,
        notes: Any = "",
        follow_up_by: Any = None,
    ) -> Any:
        if not all([customer_name, assigned_to_email, status]):
            return "Please provide all required fields: customer_name, assigned_to_email, status."
        assigned_to_email = assigned_to_email.lower()
        if customer_email:
            customer_email = customer_email.lower()
        customers = self._crm_data
        new_id = str(int(customers["customer_id"].max()) + 1).zfill(8)
        row = new_row(
            {
                "customer_id": new_id,
                "customer_name": customer_name,
                "customer_email": customer_email,
                "customer_phone": customer_phone,
                "last_contact_date": last_contact_date,
                "product_interest": product_interest,
                "status": status,
                "assigned_to_email": assigned_to_email,
                "notes": notes,
                "follow_up_by": follow_up_by,
            }
        )
        self._crm_data = pd.concat([customers, row], ignore_index=True)
        return new_id

    def delete_customer(self, customer_id: Any = None) -> Any:
        if not customer_id:
            return "Customer ID not provided."
        customers = self._crm_data
        if customer_id not in customers["customer_id"].values:
            return "Customer not found."
        self._crm_data = customers[customers["customer_id"] != customer_id]
        return "Customer deleted successfully."
