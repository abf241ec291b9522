"""Queue mailboxes: ``/v1/mailboxes/{name}/messages|deliveries``, ``/v1/messages/...``, ``/v1/deliveries/...``."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api.longpoll import in_request, long_poll
from coordination.api.presenters import present_delivery, present_message
from coordination.api.views.base import ApiView, AsyncApiView, with_errors
from coordination.domain import exceptions
from coordination.domain.states import MailboxMode, Permission
from coordination.plumbing import tracing
from coordination.reads import selectors
from coordination.services import messages as message_services
from coordination.services.mailboxes import mailbox_get


class MessageSendView(ApiView):
    """Send a message to a QUEUE mailbox."""

    @extend_schema(
        operation_id="messages_send",
        request=s.MessageSendIn,
        responses=with_errors({201: s.MessageOut, 200: OpenApiResponse(s.MessageOut, description="idempotent resend")}),
    )
    def post(self, request, name):
        """Send a message under ``runId``; the same ``key`` and body answer the existing message (200)."""
        data = self.body(s.MessageSendIn)
        mailbox = mailbox_get(project_id=self.project_id, name=name, mode=MailboxMode.QUEUE)
        run = selectors.run_get(self.visibility, data["runId"])
        with tracing.send_span(mailbox.name, self.caller_trace(), run_id=run.id) as (span, trace):
            message, created = message_services.message_send(
                project_id=self.project_id,
                mailbox=mailbox,
                run_id=run.id,
                body=data["body"],
                key=data["key"],
                trace=trace,
            )
            tracing.annotate(span, message_id=message.id)
        if not created:
            return Response(present_message(message, mailbox.name))
        return Response(
            present_message(message, mailbox.name), status=201, headers={"Location": f"/v1/messages/{message.id}"}
        )


class MessageDetailView(ApiView):
    """Read a message (dead-lettered ones included)."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="messages_retrieve", responses=with_errors({200: s.MessageOut}))
    def get(self, request, message_id):
        """Return the message."""
        return Response(present_message(selectors.message_get(self.visibility, message_id)))


class DeliveryCollectionView(AsyncApiView):
    """Receive messages of exactly one run, optionally waiting for them."""

    @extend_schema(
        operation_id="deliveries_receive", request=s.ReceiveIn, responses=with_errors({200: s.DeliveriesOut})
    )
    async def post(self, request, name):
        """Receive up to ``max`` messages of ``runId``; with ``waitMs``, wait up to that long (max 30 s) for one."""
        data = self.body(s.ReceiveIn)
        self.hold_wait(data["waitMs"])
        project_id, visibility = self.project_id, self.visibility

        def lookup():
            mailbox = mailbox_get(project_id=project_id, name=name, mode=MailboxMode.QUEUE)
            return mailbox, selectors.run_get(visibility, data["runId"])

        mailbox, run = await in_request(lookup)

        def receive():
            return message_services.message_receive(
                project_id=project_id,
                mailbox=mailbox,
                run_id=run.id,
                max_messages=data["max"],
                visibility_ms=data.get("visibilityMs"),
            )

        deliveries = await long_poll(
            receive, done=bool, topics=run.chain_ids, timeout_ms=s.clamp_wait_ms(data["waitMs"])
        )
        return Response({"deliveries": [present_delivery(d) for d in deliveries]})


class DeliveryView(ApiView):
    """Base of the operations on one delivery."""

    def visible_delivery(self, delivery_id: str) -> str:
        """Return ``delivery_id`` if the caller can see its message; else raise ``NotFound``.

        The services check the project; this adds a bound key's subtree.
        """
        message_id, _ = message_services.parse_delivery_id(delivery_id)
        try:
            selectors.message_get(self.visibility, message_id)
        except exceptions.NotFound:
            raise exceptions.NotFound("Delivery not found.", deliveryId=str(delivery_id)) from None
        return delivery_id


class DeliveryCompleteView(DeliveryView):
    """Acknowledge a delivery."""

    @extend_schema(
        operation_id="deliveries_complete", request=s.DeliveryCompleteIn, responses=with_errors({200: s.MessageOut})
    )
    def post(self, request, delivery_id):
        """Mark the message ``COMPLETED``; refused with the run's code once the run is inactive."""
        self.body(s.DeliveryCompleteIn)
        message = message_services.delivery_complete(
            project_id=self.project_id, delivery_id=self.visible_delivery(delivery_id)
        )
        return Response(present_message(message))


class DeliveryRetryView(DeliveryView):
    """Put a delivered message back in the queue."""

    @extend_schema(
        operation_id="deliveries_retry", request=s.DeliveryRetryIn, responses=with_errors({200: s.MessageOut})
    )
    def post(self, request, delivery_id):
        """Queue the message again after ``delayMs``; after the run ended it is ``CANCELLED`` instead."""
        data = self.body(s.DeliveryRetryIn)
        message = message_services.delivery_retry(
            project_id=self.project_id, delivery_id=self.visible_delivery(delivery_id), delay_ms=data["delayMs"]
        )
        return Response(present_message(message))


class DeliveryRejectView(DeliveryView):
    """Dead-letter a delivered message."""

    @extend_schema(
        operation_id="deliveries_reject", request=s.DeliveryRejectIn, responses=with_errors({200: s.MessageOut})
    )
    def post(self, request, delivery_id):
        """Mark the message ``DEAD_LETTERED`` with ``reason``; it stays readable."""
        data = self.body(s.DeliveryRejectIn)
        message = message_services.delivery_reject(
            project_id=self.project_id, delivery_id=self.visible_delivery(delivery_id), reason=data.get("reason")
        )
        return Response(present_message(message))


class DeliveryExtendView(DeliveryView):
    """Extend a delivery's visibility lease."""

    @extend_schema(
        operation_id="deliveries_extend", request=s.DeliveryExtendIn, responses=with_errors({200: s.DeliveryOut})
    )
    def post(self, request, delivery_id):
        """Hide the message ``visibilityMs`` more from now; ``LEASE_LOST`` once the delivery is stale.

        Refused with the run's code once the run is inactive.
        """
        data = self.body(s.DeliveryExtendIn)
        delivery = message_services.delivery_extend(
            project_id=self.project_id,
            delivery_id=self.visible_delivery(delivery_id),
            visibility_ms=data["visibilityMs"],
        )
        return Response(present_delivery(delivery))
